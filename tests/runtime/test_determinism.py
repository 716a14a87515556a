"""The environment a checkpoint records, and the warning a resume that cannot be exact gives."""

from __future__ import annotations

import warnings

import torch

from checkflow.determinism import (
    ResumeNotExactWarning,
    differences,
    environment,
    warn_if_different,
)


def test_environment_records_the_thread_count_torch_and_cpu_kernels():
    env = environment()
    assert env["intra_op_threads"] == torch.get_num_threads()
    assert env["torch"] == torch.__version__
    assert env["cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    assert env["deterministic_algorithms"] is torch.are_deterministic_algorithms_enabled()


def test_the_same_environment_has_no_differences():
    assert differences(environment(), environment()) == []


def test_another_thread_count_names_both_counts_and_what_to_set():
    saved = {**environment(), "intra_op_threads": 2}
    current = {**saved, "intra_op_threads": 1}
    (only,) = differences(saved, current)
    assert "intra_op_threads was 2" in only and "is 1 now" in only
    assert "OMP_NUM_THREADS=2" in only and "torch.set_num_threads(2)" in only


def test_settings_an_older_checkpoint_did_not_record_are_not_compared():
    assert differences({}, environment()) == []
    assert differences({"torch": torch.__version__}, environment()) == []


def test_every_differing_setting_is_reported():
    saved = {"torch": "1.0", "cpu_capability": "AVX512", "intra_op_threads": 64}
    current = {"torch": "2.0", "cpu_capability": "AVX2", "intra_op_threads": 64}
    found = differences(saved, current)
    assert len(found) == 2
    assert any("torch==1.0" in f for f in found)
    assert any("ATEN_CPU_CAPABILITY=AVX512" in f for f in found)


def test_warns_with_the_step_and_uri_when_the_thread_count_differs():
    saved = {**environment(), "intra_op_threads": torch.get_num_threads() + 1}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        found = warn_if_different(saved, step=170, uri="file:///ckpt")
    assert len(found) == 1
    (w,) = [c for c in caught if issubclass(c.category, ResumeNotExactWarning)]
    assert "step 170 in file:///ckpt" in str(w.message)
    assert "not be bitwise equal" in str(w.message)


def test_no_warning_when_nothing_differs():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert warn_if_different(environment(), step=1, uri="x") == []


def _train_one_step(model, opt):
    loss = model(torch.ones(4, 3)).sum()
    loss.backward()
    opt.step()
    opt.zero_grad()


def test_a_checkpoint_restored_with_another_thread_count_warns_and_one_with_the_same_does_not(
    tmp_path,
):
    from checkflow import Checkpointer

    threads = torch.get_num_threads()
    model = torch.nn.Linear(3, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    with Checkpointer(str(tmp_path), {"model": model, "optim": opt}, every=1) as ckpt:
        _train_one_step(model, opt)
        ckpt.step()
        ckpt.wait()
    other = 1 if threads > 1 else 2
    try:
        torch.set_num_threads(other)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            with Checkpointer(str(tmp_path), {"model": model, "optim": opt}, every=1) as again:
                assert again.restore() == 1
        (w,) = [c for c in caught if issubclass(c.category, ResumeNotExactWarning)]
        assert f"intra_op_threads was {threads}" in str(w.message)
        assert f"is {other} now" in str(w.message)
    finally:
        torch.set_num_threads(threads)
    with warnings.catch_warnings():
        warnings.simplefilter("error", ResumeNotExactWarning)
        with Checkpointer(str(tmp_path), {"model": model, "optim": opt}, every=1) as same:
            assert same.restore() == 1


def test_a_lossy_codec_does_not_warn_about_exactness_it_never_promised(tmp_path):
    from checkflow import Checkpointer

    threads = torch.get_num_threads()
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    state = {"model": model, "optim": opt}
    with Checkpointer(str(tmp_path), state, every=1, codec="q8") as ckpt:
        ckpt.step()
        ckpt.wait()
    try:
        torch.set_num_threads(1 if threads > 1 else 2)
        with warnings.catch_warnings():
            warnings.simplefilter("error", ResumeNotExactWarning)
            with Checkpointer(str(tmp_path), state, every=1, codec="q8") as again:
                assert again.restore() == 1
    finally:
        torch.set_num_threads(threads)
