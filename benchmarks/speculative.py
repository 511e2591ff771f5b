"""MTP speculative decoding: acceptance per draft position and decode tok/s with and without it.

Both engines live in this process and run the same greedy requests side by side (best of `--repeats`). Decode
tok/s = generated tokens past the first / (time of the whole request - time of a one-token request). On the
embedded model the prompts are KJV verse openings the model never saw whole (held-out chapters); on a
V3-shaped random checkpoint with a random MTP layer acceptance is near zero, so it measures the cost of
verifying k+1 tokens and running the MTP.
Run: `.venv/bin/python benchmarks/speculative.py [--quick] [--batch 1 4 16] [--k 1 2 3]`.
"""
from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from benchmarks.common import best_time  # noqa: E402
from latentserve import LLM, SamplingParams  # noqa: E402
from latentserve.engine.llm import default_model_dir  # noqa: E402

# Openings of verses from the held-out chapters (every 50th chapter: Genesis 1, Exodus 1, ...).
PROMPTS = [
    "In the beginning God created", "Now these are the names of the children of Israel", "And the earth was",
    "And God called the light Day", "Now there arose up a new king over Egypt", "And God saw every thing",
    "And the spirit of God moved", "And the children of Israel were fruitful", "And God made the firmament",
    "And God said, Let the earth bring forth", "And the midwives said unto Pharaoh", "And God blessed them",
    "Thus the heavens and the earth were finished", "And God set them in the firmament",
    "And Joseph died, and all his brethren", "And the evening and the morning were the third day",
]
# A V3-shaped random model: MLA, dense first layer, sigmoid-routed MoE (cost only).
RANDOM_MODEL = dict(
    vocab_size=8192, hidden_size=512, intermediate_size=1536, moe_intermediate_size=384, num_hidden_layers=4,
    num_attention_heads=8, num_key_value_heads=8, q_lora_rank=192, kv_lora_rank=128, qk_nope_head_dim=32,
    qk_rope_head_dim=16, v_head_dim=32, n_routed_experts=16, num_experts_per_tok=4, n_shared_experts=1,
    n_group=4, topk_group=2, first_k_dense_replace=1, max_position_embeddings=1024, tie_word_embeddings=False,
)


def random_mtp_checkpoint(path: Path) -> Path:
    """transformers writes L+1 layers; the last becomes the MTP layer, with random MTP inputs and output norm."""
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(0)
    layers = RANDOM_MODEL["num_hidden_layers"]
    config = DeepseekV3Config(**{**RANDOM_MODEL, "num_hidden_layers": layers + 1})
    DeepseekV3ForCausalLM(config).save_pretrained(path)
    h = RANDOM_MODEL["hidden_size"]
    weights = load_file(path / "model.safetensors")
    prefix = f"model.layers.{layers}."
    weights.update({prefix + "enorm.weight": torch.ones(h), prefix + "hnorm.weight": torch.ones(h),
                    prefix + "shared_head.norm.weight": torch.ones(h),
                    prefix + "eh_proj.weight": torch.randn(h, 2 * h) * 0.02})
    save_file(weights, path / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps({**raw, "num_hidden_layers": layers, "num_nextn_predict_layers": 1}))
    return path


def decode_rate(llm: LLM, prompts, max_tokens: int, repeats: int) -> float:
    """Decode tokens per second over the batch (the prefill step's time taken out)."""
    one = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    many = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    t_one = best_time(lambda: llm.generate(prompts, one), repeats)
    t_many = best_time(lambda: llm.generate(prompts, many), repeats)
    return len(prompts) * (max_tokens - 1) / max(t_many - t_one, 1e-9)


def bench_model(name: str, path: Path, prompts_for, args) -> None:
    engine = dict(num_threads=args.threads, max_num_seqs=max(args.batch), num_kv_blocks=512)
    base = LLM(model=path, **engine)
    spec = {k: LLM(model=path, speculative_config={"method": "mtp", "num_speculative_tokens": k}, **engine)
            for k in args.k}
    print(f"\n{name}: decode tok/s, greedy, {args.max_tokens} tokens per request, {args.threads} thread(s)")
    columns = [f"k={k} (ratio) | k={k} acceptance per position | k={k} mean accepted length" for k in args.k]
    print("| batch | no MTP | " + " | ".join(columns) + " |")
    print("|---|---|" + "---|---|---|" * len(args.k))
    for batch in args.batch:
        prompts = prompts_for(batch)
        rate = decode_rate(base, prompts, args.max_tokens, args.repeats)
        cells = [f"{rate:.1f}"]
        for k, llm in spec.items():
            stats = llm.engine.spec_decoding_stats
            before = (stats.num_drafts, stats.num_accepted_tokens, list(stats.num_accepted_tokens_per_pos),
                      list(stats.num_drafts_per_pos))
            spec_rate = decode_rate(llm, prompts, args.max_tokens, args.repeats)
            accepted = [a - b for a, b in zip(stats.num_accepted_tokens_per_pos, before[2])]
            reached = [d - b for d, b in zip(stats.num_drafts_per_pos, before[3])]
            per_pos = " / ".join(f"{a / max(d, 1):.0%}" for a, d in zip(accepted, reached))
            mean_len = 1 + (stats.num_accepted_tokens - before[1]) / max(stats.num_drafts - before[0], 1)
            cells += [f"{spec_rate:.1f} ({spec_rate / rate:.2f}x)", per_pos, f"{mean_len:.2f}"]
        print(f"| {batch} | " + " | ".join(cells) + " |", flush=True)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, nargs="+", default=[1, 4, 16])
    p.add_argument("--k", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--max-tokens", type=int, default=48)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--quick", action="store_true", help="batch 1 and 4, k=1, one repeat")
    args = p.parse_args()
    if args.quick:
        args.batch, args.k, args.repeats, args.max_tokens = [1, 4], [1], 1, 24
    torch.set_num_threads(args.threads)
    bench_model("embedded model", default_model_dir(), lambda b: [PROMPTS[i % len(PROMPTS)] for i in range(b)], args)
    with tempfile.TemporaryDirectory() as tmp:
        path = random_mtp_checkpoint(Path(tmp))
        g = torch.Generator().manual_seed(0)
        bench_model("V3-shaped random checkpoint (cost only)", path,
                    lambda b: [torch.randint(5, 8192, (32,), generator=g).tolist() for _ in range(b)], args)


if __name__ == "__main__":
    main()
