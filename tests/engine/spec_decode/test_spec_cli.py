"""--speculative-config on the command line (the embedded model, which ships an MTP layer)."""
import json

from latentserve import LLM, SamplingParams
from latentserve.cli import main

PROMPTS = ["And God said", "In the beginning"]
SPEC = '{"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": null}'  # drafting on any CPU


def _run(argv, capsys):
    try:
        code = main(argv)
    except SystemExit as e:
        code = e.code
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_generate_with_mtp_prints_the_greedy_completions(tmp_path, capsys) -> None:
    prompts_file = tmp_path / "prompts.txt"
    prompts_file.write_text("\n".join(PROMPTS) + "\n")
    code, out, err = _run(["generate", "--prompts-file", str(prompts_file), "--json", "--max-tokens", "12",
                           "--temperature", "0", "--dtype", "float32", "--num-threads", "1",
                           "--speculative-config", SPEC], capsys)
    assert code == 0, err
    expected = LLM(dtype="float32", num_threads=1).generate(PROMPTS, SamplingParams(temperature=0.0, max_tokens=12))
    assert [r["token_ids"] for r in json.loads(out)] == [o.outputs[0].token_ids for o in expected]


def test_bad_speculative_config_is_a_usage_error(capsys) -> None:
    code, _, err = _run(["generate", "--prompt", "x", "--speculative-config", "mtp"], capsys)
    assert code == 2 and "--speculative-config: not JSON" in err
    code, _, err = _run(["generate", "--prompt", "x", "--speculative-config", '{"method": "eagle"}'], capsys)
    assert code != 0 and "method must be one of" in err
