"""trainer.precision=auto: bf16-mixed where the hardware multiplies bf16 matrices natively."""

from __future__ import annotations

import pytest

pytestmark = (
    pytest.mark.hardware
)  # precision=auto's branch: .ci/run runs this file with bf16 forced on and off


@pytest.mark.parametrize(
    "flags, accelerator, expected",
    [
        ({"avx2", "amx_bf16"}, "cpu", "bf16-mixed"),
        ({"avx512f", "avx512_bf16"}, "cpu", "bf16-mixed"),
        ({"avx2", "avx512f"}, "cpu", "32-true"),
        (set(), "cpu", "32-true"),
    ],
)
def test_auto_precision_follows_the_cpu(monkeypatch, flags, accelerator, expected):
    import rope_llama.core.precision as precision

    monkeypatch.delenv(precision.FORCE_CPU_BF16, raising=False)
    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    chosen, why = precision.resolve_precision("auto", accelerator)
    assert chosen == expected and why
    assert precision.resolve_precision("32-true", accelerator) == ("32-true", "set explicitly")
    assert precision.bf16_is_native(accelerator) == (expected == "bf16-mixed", why)


def test_expand_auto_replaces_each_auto_and_keeps_first_occurrences():
    from rope_llama.core.precision import expand_auto

    assert expand_auto(["auto"], ["a-fp32", "a-bf16"]) == ["a-fp32", "a-bf16"]
    assert expand_auto(["a-bf16", "auto", "b-fp32"], ["a-fp32", "a-bf16"]) == ["a-bf16", "a-fp32", "b-fp32"]
    assert expand_auto(["auto", "fp32"], []) == ["fp32"]  # auto may stand for nothing
    assert expand_auto(["fp32", "bf16"], ["x"]) == ["fp32", "bf16"]


@pytest.mark.parametrize("forced, expected", [("1", "bf16-mixed"), ("0", "32-true")])
@pytest.mark.parametrize("flags", [{"amx_bf16"}, {"avx2"}])
def test_the_environment_forces_the_cpus_answer(monkeypatch, flags, forced, expected):
    import rope_llama.core.precision as precision

    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    monkeypatch.setenv(precision.FORCE_CPU_BF16, forced)
    assert precision.resolve_precision("auto", "cpu")[0] == expected
    monkeypatch.setenv(precision.FORCE_CPU_BF16, "yes")
    with pytest.raises(
        ValueError, match=r"^ROPE_LLAMA_FORCE_CPU_BF16='yes' is not allowed; set it to 1 or 0"
    ):
        precision.resolve_precision("auto", "cpu")


@pytest.mark.parametrize("native, expected", [(True, "bfloat16"), (False, "float32")])
def test_evaluation_dtype_auto_follows_training_precision(monkeypatch, native, expected):
    """dtype=auto (evaluation, passkey): bfloat16 exactly where precision=auto trains in bf16."""
    import torch

    import rope_llama.core.precision as precision

    monkeypatch.setenv(precision.FORCE_CPU_BF16, "1" if native else "0")
    chosen, why = precision.inference_dtype("auto", torch.device("cpu"))
    assert chosen == expected and why == precision.bf16_is_native("cpu")[1]
    assert precision.inference_dtype("float32", torch.device("cpu")) == ("float32", "set explicitly")
