"""The public re-exports stay working for users: ``checkflow.distributed`` and
``checkflow.restore`` hold no code of their own, and internal code no longer imports them
(the ``shims-for-users`` contract), so only these tests keep their names honest."""

from __future__ import annotations

import importlib

import pytest

import checkflow
import checkflow.distributed
import checkflow.restore
from checkflow.parallel import adapters, agreement, groups, sharding
from checkflow.read import api, errors, reader, state_dicts

_HOMES = {
    "checkflow.distributed": (adapters, agreement, groups, sharding, state_dicts),
    "checkflow.restore": (api, errors, reader),
}


@pytest.mark.parametrize("shim", sorted(_HOMES))
def test_every_public_name_is_the_real_object(shim: str) -> None:
    module = importlib.import_module(shim)
    assert module.__all__, shim
    for name in module.__all__:
        homes = [home for home in _HOMES[shim] if name in vars(home)]
        assert homes, f"{shim}.{name} is defined in none of its real modules"
        assert getattr(module, name) is vars(homes[0])[name], f"{shim}.{name}"


def test_the_package_names_resolve_through_the_read_path() -> None:
    assert checkflow.load is checkflow.restore.load is api.load
    assert checkflow.list_checkpoints is api.list_checkpoints
    assert checkflow.CheckpointInfo is api.CheckpointInfo


def test_user_imports_of_the_shims_keep_working() -> None:
    from checkflow.distributed import ModelState, read_state_dicts
    from checkflow.restore import RESTORE_ERRORS, CorruptCheckpointError, NoCheckpointError, load

    assert ModelState is adapters.ModelState
    assert read_state_dicts is state_dicts.read_state_dicts
    assert load is api.load
    assert NoCheckpointError in RESTORE_ERRORS or issubclass(NoCheckpointError, RESTORE_ERRORS)
    assert issubclass(CorruptCheckpointError, Exception)
