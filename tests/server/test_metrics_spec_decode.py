"""/metrics with speculative decoding and structured outputs: vLLM's spec-decode counters equal the engine's own
acceptance totals after greedy requests through a live server on the embedded model (which has an MTP layer), and are
absent without speculation; structured-output requests are counted by kind."""
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from latentserve.assets import DEFAULT_MODEL_DIR
from latentserve.engine.llm import LLM
from latentserve.engine.spec_decode.metrics import SpecDecodingStats
from latentserve.server.async_engine import _spec_decoding_stats
from latentserve.server.metrics import Metrics
from tests.server.conftest import MODEL_NAME, LiveServer

PROMPTS = ["In the beginning", "And God said", "The sons of Noah", "And it came to pass"]
SPEC = "latentserve:spec_decode_"
# Drafting whatever the CPU's cache: the default ("auto") turns it off where the weights fit in it.
SPEC_CONFIG = {"method": "mtp", "num_speculative_tokens": 2, "disable_by_batch_size": None}


def scrape(url: str) -> dict[tuple[str, tuple], float]:
    """Every sample of /metrics, keyed by (name, sorted labels)."""
    text = httpx.get(f"{url}/metrics", timeout=30).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for family in text_string_to_metric_families(text) for s in family.samples}


def complete(url: str, prompt: str, **body) -> dict:
    response = httpx.post(f"{url}/v1/completions", timeout=60,
                          json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 24, "temperature": 0, **body})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.fixture(scope="module")
def spec_server():
    server = LiveServer(DEFAULT_MODEL_DIR, speculative_config=SPEC_CONFIG)
    yield server
    server.stop()


def test_spec_decode_counters_equal_the_engine_stats(spec_server):
    model = (("model_name", MODEL_NAME),)
    before = scrape(spec_server.url)
    assert before[(f"{SPEC}num_drafts_total", model)] == 0  # exported from the start
    for prompt in PROMPTS:
        complete(spec_server.url, prompt)
    spec_server.wait_idle()
    samples = scrape(spec_server.url)
    stats = spec_server.engine.spec_decoding_stats
    drafts = samples[(f"{SPEC}num_drafts_total", model)]
    draft_tokens = samples[(f"{SPEC}num_draft_tokens_total", model)]
    accepted = samples[(f"{SPEC}num_accepted_tokens_total", model)]
    per_pos = [samples[(f"{SPEC}num_accepted_tokens_per_pos_total", (("model_name", MODEL_NAME), ("position", str(p))))]
               for p in range(2)]
    assert (drafts, draft_tokens, accepted) == (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
    assert per_pos == stats.num_accepted_tokens_per_pos
    assert drafts > 0 and 0 < accepted <= draft_tokens <= 2 * drafts
    assert sum(per_pos) == accepted and per_pos[1] <= per_pos[0]  # a later position is accepted only after the earlier
    # Every generated token is either accepted from a draft or sampled by a step: at least one step per draft.
    generated = samples[("latentserve:generation_tokens_total", model)]
    assert accepted < generated


def test_no_spec_decode_metrics_without_speculation(http):
    assert http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "ab", "max_tokens": 4}).status_code == 200
    text = http.get("/metrics").text
    assert "latentserve:generation_tokens_total" in text and "spec_decode" not in text


def test_structured_output_requests_by_kind(spec_server):
    key = lambda kind: ("latentserve:structured_output_requests_total", (("kind", kind), ("model_name", MODEL_NAME)))
    before = scrape(spec_server.url)  # every kind exported from the start
    complete(spec_server.url, "And", structured_outputs={"choice": ["yes", "no"]})
    complete(spec_server.url, "And", structured_outputs={"regex": "[a-z]+"}, max_tokens=8)
    complete(spec_server.url, "And")  # unconstrained: not counted
    after = scrape(spec_server.url)
    for kind in ("json", "regex", "choice", "grammar", "json_object"):
        assert after[key(kind)] - before[key(kind)] == (1 if kind in ("choice", "regex") else 0), kind


def test_data_parallel_ranks_are_summed():
    """Two ranks, each with its own MTP drafter: the counters are the sum of the ranks' own totals."""
    llm = LLM(model=DEFAULT_MODEL_DIR, dtype="float32", data_parallel_size=2,
              speculative_config=SPEC_CONFIG)
    server = LiveServer(DEFAULT_MODEL_DIR, engine=llm.engine)
    try:
        with ThreadPoolExecutor(2) as pool:  # two at once: one on each rank
            list(pool.map(lambda prompt: complete(server.url, prompt, max_tokens=12), PROMPTS[:2]))
        server.wait_idle()
        samples = scrape(server.url)
        ranks = llm.dp_engine.collective_rpc(_spec_decoding_stats)
        assert sum(r.num_drafts > 0 for r in ranks) == 2  # both ranks drafted
        model = (("model_name", MODEL_NAME),)
        assert samples[(f"{SPEC}num_drafts_total", model)] == sum(r.num_drafts for r in ranks)
        assert samples[(f"{SPEC}num_accepted_tokens_total", model)] == sum(r.num_accepted_tokens for r in ranks)
        for pos in range(2):
            labels = (("model_name", MODEL_NAME), ("position", str(pos)))
            assert samples[(f"{SPEC}num_accepted_tokens_per_pos_total", labels)] == sum(
                r.num_accepted_tokens_per_pos[pos] for r in ranks)
    finally:
        server.stop()
        llm.shutdown()


def test_vllm_prefix_gives_vllms_exact_names():
    stats = SpecDecodingStats(num_spec_tokens=3)
    for drafted, accepted in ((3, 3), (3, 1), (2, 0), (3, 2)):
        stats.observe_draft(drafted, accepted)
    metrics = Metrics(lambda: {"running": 0, "waiting": 0, "kv_cache_usage": 0.0}, "m", "vllm", lambda: stats)
    samples = {(s.name, tuple(sorted(s.labels.items()))): s.value
               for family in text_string_to_metric_families(metrics.render().decode()) for s in family.samples}
    m = (("model_name", "m"),)
    assert samples[("vllm:spec_decode_num_drafts_total", m)] == 4
    assert samples[("vllm:spec_decode_num_draft_tokens_total", m)] == 11
    assert samples[("vllm:spec_decode_num_accepted_tokens_total", m)] == 6
    assert [samples[("vllm:spec_decode_num_accepted_tokens_per_pos_total", m + (("position", str(p)),))]
            for p in range(3)] == [3, 2, 1]
