"""compile=auto: the blocks are compiled for long bf16 CPU runs with a C++ compiler, nowhere else."""

from __future__ import annotations

import pytest

import rope_llama.training.compile as compile_mod

pytestmark = (
    pytest.mark.hardware
)  # precision=auto's branch: .ci/run runs this file with bf16 forced on and off

LONG = compile_mod.MIN_STEPS


@pytest.fixture
def amx_cpu_with_compiler(monkeypatch):
    """A CPU whose precision=auto resolves to bf16-mixed, with g++ on the PATH and no $CXX."""
    monkeypatch.delenv("ROPE_LLAMA_FORCE_CPU_BF16", raising=False)  # the patched flags decide
    monkeypatch.setattr("rope_llama.core.precision.cpu_flags", lambda: {"amx_bf16"})
    monkeypatch.delenv("CXX", raising=False)
    monkeypatch.setattr(
        compile_mod.shutil, "which", lambda name: f"/usr/bin/{name}" if name == "g++" else None
    )


@pytest.mark.parametrize("requested", [True, False])
def test_explicit_values_are_used_as_given(amx_cpu_with_compiler, requested):
    assert compile_mod.resolve_compile(requested, "32-true", "gpu", 1) == (requested, "set explicitly")


def test_auto_compiles_a_long_bf16_cpu_run(amx_cpu_with_compiler):
    on, why = compile_mod.resolve_compile("auto", "auto", "cpu", LONG)
    assert on and "g++" in why
    assert compile_mod.resolve_compile("auto", "bf16-mixed", "cpu", LONG)[0]


@pytest.mark.parametrize(
    "precision, accelerator, steps, reason",
    [
        ("auto", "cpu", LONG - 1, f"{LONG - 1} steps do not earn back compiling"),
        ("32-true", "cpu", LONG, "bf16-mixed runs only, not 32-true"),
        ("16-mixed", "cpu", LONG, "bf16-mixed runs only, not 16-mixed"),
        ("bf16-mixed", "gpu", LONG, "on CPUs only"),
    ],
)
def test_auto_stays_eager_where_compiling_was_not_shown_to_pay(
    amx_cpu_with_compiler, precision, accelerator, steps, reason
):
    on, why = compile_mod.resolve_compile("auto", precision, accelerator, steps)
    assert not on and reason in why


def test_auto_stays_eager_without_a_cpp_compiler(amx_cpu_with_compiler, monkeypatch):
    monkeypatch.setattr(compile_mod.shutil, "which", lambda name: None)
    on, why = compile_mod.resolve_compile("auto", "auto", "cpu", LONG)
    assert not on and "no C++ compiler" in why


def test_cxx_environment_variable_names_the_compiler(amx_cpu_with_compiler, monkeypatch):
    monkeypatch.setenv("CXX", "clang++-18")
    monkeypatch.setattr(
        compile_mod.shutil, "which", lambda name: "/opt/clang" if name == "clang++-18" else None
    )
    assert compile_mod.cxx_compiler() == "clang++-18"


def test_anything_else_is_refused_in_one_sentence():
    with pytest.raises(ValueError, match=r"^compile must be true, false or auto, got 'yes'\.$"):
        compile_mod.resolve_compile("yes", "auto", "cpu", LONG)
