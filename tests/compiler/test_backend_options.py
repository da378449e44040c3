"""``options=`` validation, ``hyper_offload.backend(...)``, registration and
``skip_offload`` outside compile (nothing here compiles a model)."""

from __future__ import annotations

import math
import subprocess
import sys

import pytest
import torch

import hyper_offload
from hyper_offload import OffloadConfig
from hyper_offload.compiler.options import parse_backend_options
from hyper_offload.passes import GreedyResidencyPlanner


def test_defaults_and_accepted_keys():
    opts = parse_backend_options(None)
    assert opts.inner_compiler == "inductor" and opts.budget_fraction is None
    assert opts.config == OffloadConfig()
    opts = parse_backend_options(
        {"max_resident_activation_fraction": 0.25, "inner_compiler": "aot_eager",
         "max_host_activation_mb": 8, "planner": GreedyResidencyPlanner(refine=False)}
    )
    assert opts.budget_bytes(1000) == 250 and opts.config.max_host_bytes == 8 << 20
    assert parse_backend_options({"max_resident_activation_mb": 2}).budget_bytes(10) == 2 << 20
    assert opts.recompute == "auto" and opts.transfer_bandwidth_gbps is None
    opts = parse_backend_options({"recompute": "off", "transfer_bandwidth_gbps": 2})
    assert opts.recompute == "off" and opts.transfer_bandwidth_gbps == 2.0


def test_recompute_and_link_are_part_of_the_cache_key():
    keys = {
        parse_backend_options(o).cache_key()
        for o in ({}, {"recompute": "off"}, {"transfer_bandwidth_gbps": 1.0})
    }
    assert len(keys) == 3


def test_backend_prices_copies_at_the_given_link():
    backend = hyper_offload.backend(transfer_bandwidth_gbps=0.5)
    fw = torch.fx.symbolic_trace(torch.nn.Identity())
    link = backend.bandwidth(fw)
    assert (link.d2h_gbps, link.h2d_gbps, link.measured) == (0.5, 0.5, False)


@pytest.mark.parametrize(
    "options,key",
    [
        ({"max_resident_activation": 1}, "max_resident_activation"),
        ({"inner_compiler": "eager"}, "inner_compiler"),
        ({"max_resident_activation_mb": -1}, "max_resident_activation_mb"),
        ({"max_resident_activation_mb": math.nan}, "max_resident_activation_mb"),
        ({"max_resident_activation_mb": "1024"}, "max_resident_activation_mb"),
        ({"max_offload_activation_mb": math.inf}, "max_offload_activation_mb"),
        ({"max_host_activation_mb": -1}, "max_host_activation_mb"),
        ({"local_world_size": 0}, "local_world_size"),
        ({"pageable_fallback": "yes"}, "pageable_fallback"),
        ({"max_resident_activation_fraction": 0}, "max_resident_activation_fraction"),
        ({"max_resident_activation_fraction": 1.5}, "max_resident_activation_fraction"),
        ({"max_resident_activation_fraction": math.nan}, "max_resident_activation_fraction"),
        ({"max_resident_activation_fraction": True}, "max_resident_activation_fraction"),
        ({"max_resident_activation_fraction": 0.5, "max_resident_activation_mb": 1},
         "max_resident_activation_fraction"),
        ({"planner": "greedy"}, "planner"),
        ({"recompute": "on"}, "recompute"),
        ({"recompute": True}, "recompute"),
        ({"transfer_bandwidth_gbps": 0}, "transfer_bandwidth_gbps"),
        ({"transfer_bandwidth_gbps": math.inf}, "transfer_bandwidth_gbps"),
        ({"transfer_bandwidth_gbps": "16"}, "transfer_bandwidth_gbps"),
        ({"rewarm_on_mismatch": True}, "rewarm_on_mismatch"),
        ({"mode": "fastest"}, "mode"),
        ({"mode": "max-autotune", "inner_compiler": "aot_eager"}, "mode"),
    ],
)
def test_bad_options_raise_value_error_naming_the_key(options, key):
    with pytest.raises(ValueError, match=key):
        parse_backend_options(options)


def test_bad_options_through_torch_compile_name_the_key():
    compiled = torch.compile(lambda x: x * 2, backend="hyper_offload", options={"budget": 1})
    with pytest.raises(Exception, match="unknown key 'budget'") as raised:
        compiled(torch.randn(2, requires_grad=True))
    # what docs/compile.md says: Dynamo's wrapper (the ValueError is its ``inner_exception``);
    # backend() raises the ValueError itself, where it is built
    assert not isinstance(raised.value, ValueError)
    assert isinstance(raised.value.inner_exception, ValueError)
    with pytest.raises(ValueError, match="unknown key 'budget'"):
        hyper_offload.backend(budget=1)


def test_backend_object_from_config():
    backend = hyper_offload.backend(OffloadConfig(max_resident_activation_mb=3), inner_compiler="aot_eager")
    assert backend.options.config.max_resident_activation_mb == 3
    assert backend.options.inner_compiler == "aot_eager" and backend.reports == []
    fraction = hyper_offload.backend(OffloadConfig(), max_resident_activation_fraction=0.5)
    assert fraction.options.budget_fraction == 0.5
    with pytest.raises(TypeError, match="OffloadConfig"):
        hyper_offload.backend({"max_resident_activation_mb": 1})  # type: ignore[arg-type]


def test_registered_as_a_dynamo_backend_without_importing_hyper_offload():
    code = (
        "import sys, torch\n"
        "assert 'hyper_offload' in torch._dynamo.list_backends()\n"
        "assert 'hyper_offload' not in sys.modules\n"
        "f = torch.compile(lambda x: (x * 2).sin().sum(), backend='hyper_offload',"
        " options={'inner_compiler': 'aot_eager'})\n"
        "x = torch.randn(4, requires_grad=True)\n"
        "f(x).backward()\n"
        "assert torch.equal(x.grad, 2 * (2 * x).cos())\n"
        "assert 'hyper_offload.compiler.registry' in sys.modules\n"
        "print('ok')\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().endswith("ok")


def test_skip_offload_outside_compile_calls_the_function_unchanged():
    calls = []

    @hyper_offload.skip_offload
    def scale(x, *, by):
        calls.append(by)
        return x * by

    x = torch.randn(3)
    assert torch.equal(scale(x, by=3), x * 3) and calls == [3]
    assert scale.__name__ == "scale"
    with pytest.raises(TypeError, match="skip_offload"):
        hyper_offload.skip_offload(42)  # type: ignore[arg-type]


def test_mode_applies_inductor_settings_without_cuda_graphs():
    opts = parse_backend_options({"mode": "max-autotune"})
    assert opts.mode == "max-autotune" and opts.drops_cudagraphs
    patches = opts.inductor_patches()
    assert patches["max_autotune"] is True and "triton.cudagraphs" not in patches
    assert parse_backend_options({"mode": "default"}).mode is None
    assert not parse_backend_options({"mode": "max-autotune-no-cudagraphs"}).drops_cudagraphs
    assert parse_backend_options({}).inductor_patches() == {}
    assert parse_backend_options({"mode": "lite"}).cache_key() != parse_backend_options({}).cache_key()


def test_torch_compile_mode_reaches_the_backend_and_a_conflict_is_refused():
    from hyper_offload.compiler.registry import hyper_offload_backend

    gm = torch.fx.symbolic_trace(torch.nn.Identity())
    with pytest.raises(ValueError, match="disagree"):
        hyper_offload_backend(gm, [torch.ones(1)], options={"mode": "lite"}, mode="max-autotune")
    with pytest.raises(ValueError, match="Inductor mode"):
        hyper_offload_backend(gm, [torch.ones(1)], options={"inner_compiler": "aot_eager"},
                              mode="max-autotune")
