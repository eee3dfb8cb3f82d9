"""trainer.precision=auto: bf16-mixed where the hardware multiplies bf16 matrices natively."""

from __future__ import annotations

import pytest


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
    import training.precision as precision

    monkeypatch.setattr(precision, "cpu_flags", lambda: flags)
    chosen, why = precision.resolve_precision("auto", accelerator)
    assert chosen == expected and why
    assert precision.resolve_precision("32-true", accelerator) == ("32-true", "set explicitly")
    assert precision.bf16_is_native(accelerator) == (expected == "bf16-mixed", why)


def test_expand_auto_replaces_each_auto_and_keeps_first_occurrences():
    from training.precision import expand_auto

    assert expand_auto(["auto"], ["a-fp32", "a-bf16"]) == ["a-fp32", "a-bf16"]
    assert expand_auto(["a-bf16", "auto", "b-fp32"], ["a-fp32", "a-bf16"]) == ["a-bf16", "a-fp32", "b-fp32"]
    assert expand_auto(["auto", "fp32"], []) == ["fp32"]  # auto may stand for nothing
    assert expand_auto(["fp32", "bf16"], ["x"]) == ["fp32", "bf16"]
