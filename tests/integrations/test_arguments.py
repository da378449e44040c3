"""``OffloadArguments`` and the optional trainer packages (issue 51, item 2): settings read
beside ``TrainingArguments``, validated where written; a missing extra named."""

from __future__ import annotations

import sys

import pytest

from hyper_offload import ConfigurationError, OptionalDependencyError
from hyper_offload.integrations import OffloadArguments, OffloadDoor


def test_hf_argument_parser_reads_them_beside_training_arguments(tmp_path) -> None:
    import transformers

    parser = transformers.HfArgumentParser((transformers.TrainingArguments, OffloadArguments))
    training, offload = parser.parse_args_into_dataclasses([
        "--output_dir", str(tmp_path), "--use_cpu", "--offload_door", "eager",
        "--max_resident_activation_mb", "512", "--max_host_activation_mb", "2048",
    ])
    assert isinstance(training, transformers.TrainingArguments)
    assert offload == OffloadArguments(offload_door="eager", max_resident_activation_mb=512,
                                       max_host_activation_mb=2048)
    config = offload.offload_config()
    assert (config.max_resident_activation_mb, config.max_host_activation_mb) == (512, 2048)


def test_each_door_gets_what_was_set() -> None:
    compile_door = OffloadDoor(OffloadArguments(max_resident_activation_fraction=0.4,
                                                inner_compiler="aot_eager"))
    assert compile_door.door == "compile" and compile_door.session is None
    options = compile_door.backend.options
    assert (options.budget_fraction, options.inner_compiler) == (0.4, "aot_eager")
    eager = OffloadDoor(OffloadArguments(offload_door="eager", max_resident_activation_mb=3))
    assert eager.door == "eager" and eager.backend is None and eager.session is None
    eager.start("cpu")
    assert eager.session.config.budget_bytes == 3 << 20
    assert eager.report is None and eager.metrics() == {}


@pytest.mark.parametrize(("arguments", "names"), [
    (dict(offload_door="both"), "offload_door"),
    (dict(max_resident_activation_mb=1, max_resident_activation_fraction=0.5), "both set"),
    (dict(offload_door="eager", max_resident_activation_fraction=0.5), "eager door"),
    (dict(inner_compiler="tvm"), "inner_compiler"),
    (dict(offload_door="eager", max_resident_activation_mb=-1), "max_resident_activation_mb"),
])
def test_wrong_settings_are_refused_where_written(arguments, names) -> None:
    with pytest.raises(ConfigurationError, match=names):
        OffloadArguments(**arguments)


def test_the_package_loads_no_trainer() -> None:
    import subprocess

    code = ("import sys, hyper_offload.integrations as i; i.OffloadArguments; "
            "print(sorted(m for m in ('torch', 'transformers', 'lightning') if m in sys.modules))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120, check=True)
    assert done.stdout.split() == ["[]"]


@pytest.mark.parametrize(("name", "package", "extra"), [
    ("HyperOffloadTrainer", "transformers", "hf"),
    ("HyperOffloadCallback", "lightning", "lightning"),
])
def test_a_missing_trainer_package_names_the_extra(monkeypatch, name, package, extra) -> None:
    import hyper_offload.integrations as integrations

    module = {"hf": "hf_trainer", "lightning": "lightning_callback"}[extra]
    for loaded in [m for m in sys.modules if m == package or m.startswith(package + ".")]:
        monkeypatch.delitem(sys.modules, loaded)
    monkeypatch.setitem(sys.modules, package, None)  # import raises ImportError
    monkeypatch.delitem(sys.modules, f"hyper_offload.integrations.{module}", raising=False)
    if name in vars(integrations):  # loaded by an earlier test: load it again
        monkeypatch.delitem(vars(integrations), name)
    with pytest.raises(OptionalDependencyError, match=rf'pip install "hyper-offload\[{extra}\]"'):
        getattr(integrations, name)
