"""The one registry shape behind every plug-in picked by name."""

import pytest

from m3sdk.attention.base import BACKENDS, get_backend
from m3sdk.cache import CACHE_MANAGERS
from m3sdk.disagg.transport import TRANSPORTS
from m3sdk.errors import M3Error
from m3sdk.registry import Registry, UnknownNameError
from m3sdk.scheduler import SCHEDULERS
from m3sdk.speculative.base import DRAFTERS, SpecConfig


def test_unknown_name_is_typed_and_lists_the_known_names():
    registry: Registry[int] = Registry("widget")
    registry.register("b")(2)
    registry.register("a")(1)
    assert registry.get("a") == 1 and registry.names() == ["a", "b"]
    with pytest.raises(UnknownNameError) as e:
        registry.get("c")
    assert isinstance(e.value, M3Error) and isinstance(e.value, ValueError)
    assert e.value.known == ["a", "b"] and "'c'" in str(e.value) and "['a', 'b']" in str(e.value)


def test_builtins_are_listed_before_their_module_is_imported():
    registry: Registry[object] = Registry("thing", builtin={"json": "json"})
    assert registry.names() == ["json"] and "json" in registry
    with pytest.raises(UnknownNameError):  # the module imported, but it registers nothing under that name
        registry.get("json")


def test_every_seam_uses_it():
    assert {"torch", "triton"} <= set(BACKENDS.names())
    assert type(get_backend("torch")).__name__ == "TorchAttentionBackend"
    assert CACHE_MANAGERS.names() == ["paged"] and SCHEDULERS.names() == ["continuous"]
    assert DRAFTERS.names() == ["eagle3", "mtp", "ngram"] and TRANSPORTS.names() == ["ucx"]
    with pytest.raises(UnknownNameError, match="attention backend"):
        get_backend("flash")
    with pytest.raises(ValueError, match="speculative method must be one of"):
        SpecConfig(method="medusa")

