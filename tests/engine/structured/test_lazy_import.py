"""xgrammar (and the transformers it imports) load with the first grammar, not with latentserve."""
import subprocess
import sys


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys; print(' '.join(sys.modules))"],
                         capture_output=True, text=True, check=True).stdout
    return set(out.split())


def test_import_does_not_load_xgrammar_or_transformers():
    modules = _loaded_after("import latentserve; from latentserve import LLM")
    assert "xgrammar" not in modules and "transformers" not in modules


def test_building_a_grammar_loads_xgrammar():
    code = ("from latentserve.engine.structured.backend import build_grammar\n"
            "from latentserve.structured_params import StructuredOutputsParams\n"
            "build_grammar(StructuredOutputsParams(regex='a+'))")
    assert "xgrammar" in _loaded_after(code)
