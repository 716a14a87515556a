"""What the docs' runnable blocks need around them: a prelude per block kind, by name.

``code`` defines the names a block uses and does not define (a model, an optimizer, a
loader), as small as will run; ``substitutions`` are the only changes made to the block's
own text, each ``(as written, what runs here)``, for hosts and buckets that do not exist
here; ``check`` runs after the block and asserts that it did what the docs say. ``{root}``
(the test's folder), ``{coordinator}`` (a real ``checkflow serve``), ``{s3_endpoint}`` and
``{bucket}`` (the tests' moto server and a new bucket on it) are filled in by the test.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class Prelude:
    code: str = ""
    substitutions: tuple[tuple[str, str], ...] = ()
    check: str = ""
    needs: frozenset[str] = frozenset()
    """Servers it needs: ``coordinator``, ``s3``."""


TINY_MODEL = '''\
import torch
from types import SimpleNamespace
from torch import nn


class TinyLM(nn.Module):
    """An embedding and a head; ``model(tokens).loss`` as a Hugging Face model gives it."""

    def __init__(self):
        super().__init__()
        self.emb, self.head = nn.Embedding(64, 8), nn.Linear(8, 64)

    def forward(self, tokens):
        logits = self.head(self.emb(tokens[:, :-1])).flatten(0, 1)
        return SimpleNamespace(loss=nn.functional.cross_entropy(logits, tokens[:, 1:].flatten()))


class Loader:
    """A resumable loader: its position is its state."""

    def __init__(self):
        self.pos = 0

    def __call__(self):
        self.pos += 1
        return torch.randint(0, 64, (4, 9), generator=torch.Generator().manual_seed(self.pos))

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, sd):
        self.pos = sd["pos"]


torch.manual_seed(0)
model = TinyLM()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
sched = torch.optim.lr_scheduler.StepLR(opt, 10)
loader = batch = Loader()
state = {"model": model, "optim": opt}
total_steps = 30
uri = "{root}/run-42"
'''

LOCAL_ROOT = ("s3://bucket/run-42", "{root}/run-42")

LIGHTNING = """\
import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint


class Module(L.LightningModule):
    def __init__(self):
        super().__init__()
        self.net = torch.nn.Linear(4, 1)

    def training_step(self, batch, i):
        return torch.nn.functional.mse_loss(self.net(batch[0]), batch[1])

    def validation_step(self, batch, i):
        self.log("val_loss", torch.nn.functional.mse_loss(self.net(batch[0]), batch[1]))

    def val_dataloader(self):
        return loader

    def configure_optimizers(self):
        return torch.optim.SGD(self.parameters(), lr=0.1)


torch.manual_seed(0)
data = torch.utils.data.TensorDataset(torch.randn(120, 4), torch.randn(120, 1))
loader = torch.utils.data.DataLoader(data, batch_size=4)
module = Module()
"""

TRANSFORMERS = """\
import torch
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Tokens(torch.utils.data.Dataset):
    def __init__(self):
        self.ids = torch.randint(0, 64, (120, 16), generator=torch.Generator().manual_seed(1))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


torch.manual_seed(0)
model = GPT2LMHeadModel(GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2))
args = TrainingArguments(output_dir="{root}/hf", per_device_train_batch_size=2, max_steps=50,
                         save_strategy="no", report_to=[], use_cpu=True, disable_tqdm=True)
ds = Tokens()
"""

MINIO = 'minio = {"client_kwargs": {"endpoint_url": "{s3_endpoint}"}, "key": "K", "secret": "S"}\n'
GC_THREE_STEPS = f"""python - <<'EOF'
import torch
from checkflow import Checkpointer
{MINIO}
with Checkpointer("s3://{{bucket}}/run-42", {{"m": torch.nn.Linear(2, 2)}}, every=1, keep=3,
                  storage_options=minio) as ckpt:
    for step in range(3):
        ckpt.step()
EOF
"""
"""Three committed steps for ``gc --keep 1`` to thin (a shell prelude)."""
GC_KEPT_ONE = f"""python - <<'EOF'
from checkflow import list_checkpoints
{MINIO}
steps = [c.step for c in list_checkpoints("s3://{{bucket}}/run-42", storage_options=minio)]
assert steps == [3], steps
EOF
"""

STEP_50_COMMITTED = """
from checkflow import list_checkpoints

assert 50 in [c.step for c in list_checkpoints("{root}/run-42")], list_checkpoints("{root}/run-42")
"""

PRELUDES = {
    "none": Prelude(),
    "tiny_model": Prelude(
        TINY_MODEL,
        (LOCAL_ROOT, ('coordinator="http://coord:8470"', 'coordinator="{coordinator}"')),
        check="\nassert [c.step for c in list_checkpoints(uri)][-1] == total_steps\n",
        needs=frozenset({"coordinator"}),
    ),
    "s3_endpoint": Prelude(
        TINY_MODEL + "from checkflow import Checkpointer\n",
        (("http://127.0.0.1:9000", "{s3_endpoint}"), ("s3://bucket/", "s3://{bucket}/")),
        check="\nwith ckpt:\n    assert ckpt.save().result() == 0\n",
        needs=frozenset({"s3"}),
    ),
    "s3_gc": Prelude(
        GC_THREE_STEPS,
        (("http://127.0.0.1:9000", "{s3_endpoint}"), ("s3://bucket/", "s3://{bucket}/")),
        check=GC_KEPT_ONE,
        needs=frozenset({"s3"}),
    ),
    "coordinator_url": Prelude(
        TINY_MODEL
        + (
            'from checkflow import Checkpointer\nURL = "{coordinator}"\n\n\n'
            "def evaluate(model):\n    model.eval()\n\n\n"
        ),
        check=(
            "\nimport httpx\nwith ckpt:\n    ckpt.step()\n"
            'auth = {"Authorization": "Bearer test-token"}  # tests.support.coordinator.TOKEN\n'
            'job = httpx.get(URL + "/v1/jobs/run-42", headers=auth)\n'
            'assert job.json()["hang_timeout_s"] == 120, job.text\n'
        ),
        needs=frozenset({"coordinator"}),
    ),
    "coordinator_cli": Prelude(
        substitutions=(("http://127.0.0.1:8470", "{coordinator}"),),
        check="\nls runs/ddp/step-000000200 runs/ddp-job/step-000000200 > /dev/null\n",
        needs=frozenset({"coordinator"}),
    ),
    "lightning": Prelude(
        LIGHTNING,
        (
            LOCAL_ROOT,
            ("L.Trainer(", "L.Trainer(max_epochs=2, logger=False, enable_progress_bar=False,"),
        ),
        check=STEP_50_COMMITTED,
    ),
    "transformers": Prelude(TRANSFORMERS, (LOCAL_ROOT,), check=STEP_50_COMMITTED),
}
