"""Issue 49, case 10: ``OffloadConfig`` and ``OffloadSession`` refuse bad arguments with
the errors README promises (the table "Errors"): a value of the wrong type raises
``ConfigurationTypeError`` (a ``ConfigurationError`` and a ``TypeError``), a misspelt
field a ``ConfigurationError`` naming the field it most likely meant, and a device this
process cannot use a ``ConfigurationError`` naming the device and the fix."""

from __future__ import annotations

import copy
import dataclasses
import pickle

import pytest
import torch

from hyper_offload import OffloadConfig, OffloadSession
from hyper_offload.errors import ConfigurationError, ConfigurationTypeError


@pytest.mark.parametrize("field, value", [
    ("max_resident_activation_mb", "512"),
    ("max_host_activation_mb", "1"),
    ("max_offload_activation_mb", [1]),
    ("verify", 1),
    ("verify", None),
    ("max_warmups", "3"),
    ("max_warmups", 2.0),
    ("local_world_size", "2"),
    ("rewarm_on_mismatch", "yes"),
    ("pageable_fallback", 1),
    ("planner", 3),
])
def test_a_value_of_the_wrong_type_raises_configuration_type_error(field: str, value: object):
    with pytest.raises(ConfigurationTypeError, match=field if field != "verify" else "verify") as info:
        OffloadConfig(**{field: value})
    assert isinstance(info.value, TypeError) and isinstance(info.value, ConfigurationError)
    assert repr(value) in str(info.value)


@pytest.mark.parametrize("field, value", [
    ("max_resident_activation_mb", -1), ("max_host_activation_mb", float("nan")),
    ("verify", "always"), ("verify", "first_steps:0"), ("max_warmups", 0),
    ("local_world_size", 0),
])
def test_a_value_out_of_range_is_a_configuration_error_not_a_type_error(field, value):
    with pytest.raises(ConfigurationError) as info:
        OffloadConfig(**{field: value})
    assert not isinstance(info.value, TypeError)


def test_an_unknown_field_names_the_closest_one() -> None:
    with pytest.raises(ConfigurationError, match="unknown field 'max_resident_mb'; did you mean "
                       "'max_resident_activation_mb'") as info:
        OffloadConfig(max_resident_mb=5)  # type: ignore[call-arg]
    assert not isinstance(info.value, TypeError)
    with pytest.raises(ConfigurationError, match="rewarm_on_mismatch"):
        OffloadConfig(rewarm_on_mismatches=True)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationError, match="the fields are max_resident_activation_mb"):
        OffloadConfig(zzz=1)  # type: ignore[call-arg]
    with pytest.raises(ConfigurationTypeError, match="keyword arguments only"):
        OffloadConfig(512)  # type: ignore[misc]


def test_the_check_keeps_the_dataclass_whole() -> None:
    """The keyword check lives in ``__new__``: the generated ``__init__``, ``replace``,
    ``repr``, equality, copies and pickling work as for any frozen dataclass."""
    config = OffloadConfig(max_resident_activation_mb=3, verify="first_steps:2")
    assert copy.deepcopy(config) == config == pickle.loads(pickle.dumps(config))
    assert dataclasses.replace(config, max_warmups=2).max_warmups == 2
    with pytest.raises(ConfigurationError, match="did you mean 'max_warmups'"):
        dataclasses.replace(config, max_warmup=2)
    assert "max_resident_activation_mb=3" in repr(config)
    with pytest.raises(dataclasses.FrozenInstanceError):
        config.max_warmups = 5  # type: ignore[misc]


def _unusable_devices() -> list[object]:
    """Devices this process cannot use: CUDA on a machine without one, else an index past
    the device count."""
    if not torch.accelerator.is_available():
        return ["cuda", "cuda:0", 0]
    kind = torch.accelerator.current_accelerator().type
    return [f"{kind}:{torch.accelerator.device_count()}"]


@pytest.mark.parametrize("device", _unusable_devices())
def test_a_device_this_process_cannot_use_is_refused_by_name(device: object) -> None:
    with pytest.raises(ConfigurationError, match=rf"OffloadSession: device={device!r}") as info:
        OffloadSession(device=device)  # type: ignore[arg-type]
    assert "pass" in str(info.value)  # the fix


def test_a_meta_or_unknown_device_is_refused_by_name() -> None:
    with pytest.raises(ConfigurationError, match="device='meta' has no memory"):
        OffloadSession(device="meta")
    with pytest.raises(ConfigurationError, match="device='bogus' is no torch device"):
        OffloadSession(device="bogus")
    assert OffloadSession(device="cpu").device == torch.device("cpu")
