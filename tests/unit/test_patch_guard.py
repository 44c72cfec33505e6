"""Patch rules: version range, signature check, idempotent install, undo."""

import pytest

from robust_plugins.errors import HostVersionError
from robust_plugins.patches import _guard


def test_version_range_message():
    _guard.check_version("deepspeed", "0.19.8", (0, 19, 0), (0, 20, 0))
    with pytest.raises(HostVersionError) as info:
        _guard.check_version("deepspeed", "0.20.1", (0, 19, 0), (0, 20, 0))
    msg = str(info.value)
    assert "deepspeed 0.20.1" in msg and ">=0.19.0,<0.20.0" in msg


def test_signature_mismatch_names_expected_parameters():
    def allreduce_bucket(self, bucket, group):
        pass

    with pytest.raises(HostVersionError, match="bucket, dp_group, dp_world_size"):
        _guard.check_signature("deepspeed", allreduce_bucket, ["self", "bucket", "dp_group", "dp_world_size"], "x")


def test_bind_instance_is_idempotent_and_undoable():
    class Host:
        def f(self):
            return "host"

    h, other = Host(), Host()
    calls = []

    def replacement():
        calls.append(1)
        return "plugin"

    _guard.bind_instance(h, "f", replacement)
    _guard.bind_instance(h, "f", replacement)  # same qualified name, same layer: a no-op
    _guard.bind_instance(h, "f", lambda: "twice", layer=replacement.__code__.co_qualname)
    assert h.f() == "plugin" and other.f() == "host" and len(calls) == 1
    assert h.f.__wrapped__() == "host"
    _guard.unbind_instance(h, "f")
    assert h.f() == "host"


def test_bind_instance_stacks_a_second_feature_instead_of_dropping_it():
    class Host:
        def f(self, x):
            return [f"host{x}"]

    h = Host()
    inner = h.f
    _guard.bind_instance(h, "f", lambda x: inner(x) + ["first"], layer="first")
    middle = h.f
    _guard.bind_instance(h, "f", lambda x: middle(x) + ["second"], layer="second")
    _guard.bind_instance(h, "f", lambda x: ["again"], layer="first")  # deeper in the chain: no-op
    assert h.f(1) == ["host1", "first", "second"]
    _guard.unbind_instance(h, "f")
    assert h.f(1) == ["host1"]


def test_deepspeed_install_idempotent_and_undo():
    import deepspeed

    from robust_plugins.patches import deepspeed as ds_patch

    ds_patch.install()
    patched = deepspeed.initialize
    ds_patch.install()
    assert deepspeed.initialize is patched and _guard.is_patched(patched)
    ds_patch.undo()
    assert not _guard.is_patched(deepspeed.initialize)
    assert deepspeed.initialize is patched.__wrapped__
    ds_patch.install()
    assert _guard.is_patched(deepspeed.initialize)
