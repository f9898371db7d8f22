"""The engines implement every capability they declare (a Protocol's own stub, inherited,
would be a silent no-op), and a sync refuses an engine without its capability."""

import inspect

import pytest

from moe_rl.rollout import contracts
from moe_rl.rollout.local import LocalEngine
from moe_rl.rollout.sglang.engine import SGLangEngine

CAPABILITIES = [
    obj
    for _, obj in inspect.getmembers(contracts, inspect.isclass)
    if getattr(obj, "_is_protocol", False) and obj.__module__ == contracts.__name__
]


def _protocol_methods(protocol: type) -> set[str]:
    return {
        name
        for klass in protocol.__mro__
        if klass.__module__ == contracts.__name__
        for name, value in vars(klass).items()
        if inspect.isfunction(value) and not name.startswith("_")
    }


@pytest.mark.parametrize("engine", [LocalEngine, SGLangEngine], ids=lambda e: e.__name__)
def test_declared_capabilities_are_implemented(engine: type) -> None:
    declared = [c for c in CAPABILITIES if issubclass(engine, c) and c in engine.__mro__]
    assert declared, f"{engine.__name__} declares no capability"
    for capability in declared:
        for name in _protocol_methods(capability):
            owner = next(k for k in engine.__mro__ if name in vars(k))
            assert owner.__module__ != contracts.__name__, f"{engine.__name__}.{name} is {capability.__name__}'s stub"


def test_sglang_declares_what_its_syncs_and_placement_need() -> None:
    for capability in (
        contracts.DistributedWeightReceiver,
        contracts.TensorWeightReceiver,
        contracts.MemoryReleaser,
    ):
        assert capability in SGLangEngine.__mro__
    assert contracts.InProcessWeightReceiver in LocalEngine.__mro__
    assert not issubclass(LocalEngine, contracts.DistributedWeightReceiver)


def test_a_sync_refuses_an_engine_without_its_capability() -> None:
    from moe_rl.rollout.weight_sync.distributed import DistributedSync
    from moe_rl.rollout.weight_sync.in_process import InProcessSync
    from moe_rl.rollout.weight_sync.tensor import TensorSync

    class DiskOnly:
        def update_weights_from_disk(self, model_path: str, weight_version: str) -> None: ...

    for make, needs in [
        (lambda e: InProcessSync(e), "InProcessWeightReceiver"),
        (lambda e: DistributedSync(e, bucket_bytes=1024, dtype=None), "DistributedWeightReceiver"),
        (lambda e: TensorSync(e, bucket_bytes=1024, dtype=None), "TensorWeightReceiver"),
    ]:
        with pytest.raises(TypeError, match=needs):
            make(DiskOnly())
    InProcessSync(None)  # off the first rank there is no engine
