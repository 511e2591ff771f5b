"""Train latentserve's embedded default model: a tiny DeepSeek-V3 (MLA + MoE) on the King James Bible.

The corpus comes from Debian's `bible-kjv-text` package (its data file is compressed; the `bible` reader
from `bible-kjv`, same source package, decodes it). Everything else is trained here: a byte-level BPE
tokenizer and a `transformers.DeepseekV3ForCausalLM`, written as a Hugging Face checkpoint.

    nice -n 10 .venv/bin/python scripts/train_default_model.py              # the shipped model
    .venv/bin/python scripts/train_default_model.py --out-dir /tmp/m --steps 20   # a quick run
    nice -n 10 .venv/bin/python scripts/train_default_model.py --mtp-only   # retrain only the MTP layer

After the main model, the script trains one multi-token-prediction (MTP) layer on top of it with the main model
frozen (DeepSeek-V3 report, section 2.2), stored as `model.layers.{num_hidden_layers}.*` as DeepSeek-V3 ships it
but without its own `embed_tokens` and `shared_head.head`: those are the main model's (shared, as in DeepSeek-V3).
"""
from __future__ import annotations

import argparse
import json
import math
import platform
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import tokenizers
import torch
import transformers
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM, GenerationConfig, PreTrainedTokenizerFast
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

sys.path.insert(0, str(Path(__file__).resolve().parent))  # its MTP stage sits beside it, however it is loaded
from default_model_mtp import (  # noqa: E402
    eval_mtp, load_mtp_layer, new_mtp_layer, save_mtp, train_mtp, write_mtp_report)

REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT_DIR = REPO_ROOT / "latentserve" / "assets" / "default_model"
BIBLE_DATA = Path("/usr/lib/bible.data")
DEBIAN_PACKAGES = ("bible-kjv-text", "bible-kjv")
INSTALL_HINT = "apt-get update && apt-get install -y bible-kjv-text bible-kjv"
VERSE_RE = re.compile(r"^([1-3]?[A-Za-z]+)(\d+):(\d+) (.*)$")

BOS, EOS, PAD, USER, ASSISTANT = "<|begin_of_text|>", "<|end_of_text|>", "<|pad|>", "<|User|>", "<|Assistant|>"
SPECIAL_TOKENS = [BOS, EOS, PAD, USER, ASSISTANT]  # ids 0..4, so bos=0 and eos=1 as in DeepseekV3Config
# DeepSeek-V3's chat layout with our own role markers; the model learns it from verse-pair dialogues.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\\n\\n' }}"
    "{% elif message['role'] == 'user' %}{{ '" + USER + "' + message['content'] }}"
    "{% elif message['role'] == 'assistant' %}{{ '" + ASSISTANT + "' + message['content'] + eos_token }}"
    "{% else %}{{ raise_exception('unsupported chat role: ' + message['role']) }}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '" + ASSISTANT + "' }}{% endif %}"
)
SAMPLE_PROMPT = "And God said"


@dataclass
class Chapter:
    book: str
    number: int
    verses: list[str]


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out-dir", type=Path, default=DEFAULT_OUT_DIR, help="where the checkpoint is written")
    p.add_argument("--steps", type=int, default=560, help="optimizer steps (the LR schedule spans them)")
    p.add_argument("--time-budget-min", type=float, default=35.0,
                   help="stop after this many minutes of training, even mid-schedule")
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=256)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--seed", type=int, default=1611)
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--mtp-only", action="store_true",
                   help="keep the main model and tokenizer in --out-dir; train and write only the MTP layer")
    p.add_argument("--mtp-steps", type=int, default=800)
    p.add_argument("--mtp-time-budget-min", type=float, default=55.0)
    p.add_argument("--mtp-lr", type=float, default=2e-3)
    p.add_argument("--mtp-loss-weight", type=float, default=0.3,
                   help="lambda of the V3 report's MTP loss (0.3 there for the first 10T tokens)")
    p.add_argument("--mtp-distill", type=float, default=0.5,
                   help="share of the MTP loss that is KL to the frozen main model's prediction (0: the report's CE)")
    p.add_argument("--mtp-resume", action="store_true",
                   help="start from the MTP layer in --out-dir, not from a copy of the main model's last layer")
    p.add_argument("--mtp-save-every", type=int, default=100, help="evaluate and write the MTP layer every N steps")
    args = p.parse_args()
    for name in ("steps", "batch_size", "seq_len", "vocab_size", "log_every", "mtp_steps", "mtp_save_every"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    for name in ("time_budget_min", "mtp_time_budget_min", "mtp_lr", "mtp_loss_weight"):
        if getattr(args, name) <= 0:
            p.error(f"--{name.replace('_', '-')} must be positive, got {getattr(args, name)}")
    if not 0 <= args.mtp_distill <= 1:
        p.error(f"--mtp-distill must be in [0, 1], got {args.mtp_distill}")
    return args


def load_corpus() -> list[Chapter]:
    """Every verse of the KJV, grouped by chapter, decoded from the installed Debian data file."""
    reader = shutil.which("bible")
    if not BIBLE_DATA.is_file() or reader is None:
        sys.exit(f"error: the KJV corpus is missing ({BIBLE_DATA} and the `bible` reader). Install it with:\n"
                 f"    {INSTALL_HINT}")
    # -f turns pretty-printing off: one "Ge1:1 text" line per verse.
    out = subprocess.run([reader, "-f", "gen1:1-rev22:21"], check=True, capture_output=True, text=True).stdout
    chapters: list[Chapter] = []
    for line in out.splitlines():
        m = VERSE_RE.match(line)
        if m is None:
            sys.exit(f"error: unexpected line from `bible`: {line!r}")
        book, chapter, text = m.group(1), int(m.group(2)), m.group(4).strip()
        if not chapters or (chapters[-1].book, chapters[-1].number) != (book, chapter):
            chapters.append(Chapter(book, chapter, []))
        chapters[-1].verses.append(text)
    return chapters


def package_version(name: str) -> str:
    out = subprocess.run(["dpkg-query", "-W", "-f=${Version}", name], capture_output=True, text=True)
    return out.stdout.strip() or "unknown"


def chapter_text(ch: Chapter) -> str:
    return "\n".join(ch.verses)


def train_tokenizer(texts: list[str], vocab_size: int) -> Tokenizer:
    """Byte-level BPE that prepends BOS when asked for special tokens (as DeepSeek's tokenizer does)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer=trainer)
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, bos_id)])
    return tok


def hf_tokenizer(tok: Tokenizer) -> PreTrainedTokenizerFast:
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT], chat_template=CHAT_TEMPLATE, model_max_length=512)


def build_stream(chapters: list[Chapter], hf_tok: PreTrainedTokenizerFast, gen: torch.Generator) -> torch.Tensor:
    """Shuffled documents, each BOS ... EOS: whole chapters, plus one-verse dialogues (user verse, next verse)."""
    docs = [hf_tok(chapter_text(ch), verbose=False)["input_ids"] + [hf_tok.eos_token_id] for ch in chapters]
    for ch in chapters:
        # About one dialogue per ten verses keeps chat a minor part of the mix.
        for i in torch.randperm(len(ch.verses) - 1, generator=gen)[: max(1, len(ch.verses) // 10)].tolist():
            messages = [{"role": "user", "content": ch.verses[i]}, {"role": "assistant", "content": ch.verses[i + 1]}]
            docs.append(hf_tok.apply_chat_template(messages, tokenize=True, return_dict=False))
    order = torch.randperm(len(docs), generator=gen).tolist()
    return torch.tensor([t for i in order for t in docs[i]], dtype=torch.long)


def model_config(vocab_size: int, tok: PreTrainedTokenizerFast) -> DeepseekV3Config:
    return DeepseekV3Config(
        vocab_size=vocab_size, hidden_size=256, intermediate_size=768, moe_intermediate_size=256,
        num_hidden_layers=4, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        q_lora_rank=128, kv_lora_rank=64, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=1, n_group=2, topk_group=1,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=512, num_mtp_layers=0,
        tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id,
        pad_token_id=tok.pad_token_id)


class ExpertLoadBalancer:
    """DeepSeek-V3's auxiliary-loss-free balancing: nudge each router's e_score_correction_bias toward even load."""

    def __init__(self, model: torch.nn.Module, rate: float) -> None:
        self.rate = rate
        self.routers = [m for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)]
        self.loads = [torch.zeros(r.num_experts) for r in self.routers]
        for router, load in zip(self.routers, self.loads):
            router.register_forward_hook(self._counter(load))

    @staticmethod
    def _counter(load: torch.Tensor):
        def hook(module, inputs, output):
            load.add_(torch.bincount(output[2].flatten(), minlength=load.numel()))
        return hook

    @torch.no_grad()
    def step(self) -> float:
        """Update the biases from the loads since the last call; returns the worst max/mean load ratio."""
        worst = 0.0
        for router, load in zip(self.routers, self.loads):
            router.e_score_correction_bias += self.rate * torch.sign(load.mean() - load)
            worst = max(worst, (load.max() / load.mean().clamp_min(1)).item())
            load.zero_()
        return worst


def lr_at(progress: float, peak: float, warmup: float = 0.03) -> float:
    """Linear warmup, then cosine to a tenth of the peak; progress runs 0 -> 1."""
    if progress < warmup:
        return peak * progress / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup)))))


def random_batch(stream: torch.Tensor, batch: int, seq_len: int, gen: torch.Generator) -> torch.Tensor:
    starts = torch.randint(0, stream.numel() - seq_len - 1, (batch,), generator=gen)
    return torch.stack([stream[s:s + seq_len + 1] for s in starts.tolist()])


@torch.no_grad()
def eval_loss(model: torch.nn.Module, stream: torch.Tensor, seq_len: int) -> float:
    """Mean next-token loss over consecutive windows of a held-out stream."""
    model.eval()
    windows = stream[: stream.numel() // (seq_len + 1) * (seq_len + 1)].view(-1, seq_len + 1)
    losses = [model(input_ids=w[None, :-1], labels=w[None, :-1]).loss.item() for w in windows]
    model.train()
    return sum(losses) / len(losses)


def train(model, stream, args, gen) -> dict:
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, betas=(0.9, 0.95), weight_decay=0.1)
    balancer = ExpertLoadBalancer(model, rate=1e-3)
    budget_s = args.time_budget_min * 60
    start, recent, step = time.time(), [], 0
    model.train()
    # The schedule follows steps only, so a run that completes them is reproducible; the budget is a hard stop.
    while step < args.steps and time.time() - start < budget_s:
        for group in opt.param_groups:
            group["lr"] = lr_at(step / args.steps, args.lr)
        batch = random_batch(stream, args.batch_size, args.seq_len, gen)
        # HF shifts labels internally: inputs and labels are the same window.
        loss = model(input_ids=batch[:, :-1], labels=batch[:, :-1]).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        imbalance = balancer.step()
        step += 1
        recent = (recent + [loss.item()])[-50:]
        if step % args.log_every == 0 or step == 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  avg50 {sum(recent) / len(recent):.3f}  "
                  f"lr {opt.param_groups[0]['lr']:.2e}  max/mean expert load {imbalance:.2f}  "
                  f"elapsed {time.time() - start:6.0f}s", flush=True)
    ended_by = "" if step == args.steps else " (the time budget ended training)"
    return {"steps": step, "wall_s": time.time() - start, "final_loss": sum(recent) / len(recent), "ended_by": ended_by}


def greedy_sample(model, tok: PreTrainedTokenizerFast, prompt: str, new_tokens: int = 48) -> str:
    model.eval()
    ids = tok(prompt, return_tensors="pt")["input_ids"]
    out = model.generate(ids, max_new_tokens=new_tokens, do_sample=False)
    return tok.decode(out[0], skip_special_tokens=True)


def save_checkpoint(model, tok: PreTrainedTokenizerFast, words: list[str], out_dir: Path) -> None:
    """bf16 weights, except the router (weight and correction bias) kept in fp32 as DeepSeek-V3 ships it."""
    out_dir.mkdir(parents=True, exist_ok=True)
    router_tensors = {id(t) for m in model.modules() if isinstance(m, DeepseekV3TopkRouter)
                      for t in (*m.parameters(), *m.buffers())}
    for t in (*model.parameters(), *model.buffers()):
        if id(t) not in router_tensors:  # cast in place: a round trip through bf16 would round the router too
            t.data = t.data.to(torch.bfloat16)
    model.save_pretrained(out_dir)
    (out_dir / "model.safetensors").chmod(0o644)  # safetensors writes 0600; the file ships to every user
    model.generation_config = GenerationConfig(
        bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id,
        do_sample=False, max_new_tokens=64)
    model.generation_config.save_pretrained(out_dir)
    # The template goes inside tokenizer_config.json (not chat_template.jinja) for readers other than transformers.
    tok.save_pretrained(out_dir, save_jinja_files=False)
    # The v4 and v5 name of the fast tokenizer class (v5 would write its alias, TokenizersBackend).
    tok_config_path = out_dir / "tokenizer_config.json"
    tok_config = json.loads(tok_config_path.read_text())
    tok_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    tok_config_path.write_text(json.dumps(tok_config, indent=2) + "\n")
    # The corpus vocabulary, so tests can judge generated text without the Debian package.
    (out_dir / "corpus_words.txt").write_text("\n".join(words) + "\n")


def corpus_words(chapters: list[Chapter]) -> list[str]:
    return sorted({w.lower() for ch in chapters for v in ch.verses for w in re.findall(r"[A-Za-z']+", v)})


def write_report(out_dir: Path, args, stats: dict) -> None:
    s = stats
    cmd = (f"nice -n 10 .venv/bin/python scripts/train_default_model.py --steps {args.steps} "
           f"--time-budget-min {args.time_budget_min:g} --batch-size {args.batch_size} --seq-len {args.seq_len} "
           f"--lr {args.lr:g} --vocab-size {args.vocab_size} --seed {args.seed}")
    (out_dir / "TRAINING.md").write_text(f"""# latentserve default model

A tiny DeepSeek-V3 (MLA attention + group-limited MoE) trained from scratch on the King James Bible, so that
`make demo` produces recognisable English with no network. It is a toy: it knows only KJV English.

## Corpus
- King James Version (1611, public domain), Debian package `bible-kjv-text` {s['text_version']}
  (`/usr/lib/bible.data`, decoded with the `bible` reader from `bible-kjv` {s['reader_version']}).
- {s['chapters']} chapters, {s['verses']} verses, {s['words']:,} words, {s['chars']:,} characters.
- Documents: each chapter (verses joined by newlines) as `{BOS} ... {EOS}`, plus {s['dialogues']:,} one-verse
  dialogues rendered with the chat template (user: a verse, assistant: the next verse).
- Held out for validation: every 50th chapter ({s['val_chapters']} chapters).
- Training stream: {s['train_tokens']:,} tokens; validation stream {s['val_tokens']:,} tokens.

## Tokenizer
Byte-level BPE trained here on the whole corpus with `tokenizers` {tokenizers.__version__}, vocab {s['vocab']}; special tokens
{', '.join(f'`{t}`' for t in SPECIAL_TOKENS)} (ids 0-4). Encoding with special tokens prepends `{BOS}`.

## Model
`transformers.DeepseekV3ForCausalLM` ({transformers.__version__}): hidden {s['cfg'].hidden_size},
{s['cfg'].num_hidden_layers} layers (first {s['cfg'].first_k_dense_replace} dense), {s['cfg'].num_attention_heads} heads,
q_lora_rank {s['cfg'].q_lora_rank}, kv_lora_rank {s['cfg'].kv_lora_rank}, qk_nope/rope/v head dims
{s['cfg'].qk_nope_head_dim}/{s['cfg'].qk_rope_head_dim}/{s['cfg'].v_head_dim}, {s['cfg'].n_routed_experts} routed experts
(top-{s['cfg'].num_experts_per_tok}, {s['cfg'].n_group} groups, top-{s['cfg'].topk_group} group) + {s['cfg'].n_shared_experts}
shared, expert width {s['cfg'].moe_intermediate_size}, dense width {s['cfg'].intermediate_size}, default RoPE
(rope_interleave={s['cfg'].rope_interleave}), untied embeddings, one MTP layer (below).
{s['params']:,} parameters ({s['active_params']:,} active per token); the main model takes {s['file_mb']:.1f} MB of `model.safetensors`
(bf16; router weights and `e_score_correction_bias` in fp32).
Routers were balanced with DeepSeek-V3's auxiliary-loss-free bias update (rate 1e-3 per step), so
`e_score_correction_bias` is non-zero.

## Training
Plain PyTorch AdamW (betas 0.9/0.95, weight decay 0.1, grad clip 1.0), peak LR {args.lr:g}, 3% warmup then cosine to
10%, fp32 on CPU with one thread ({platform.processor() or platform.machine()}, torch {torch.__version__}), seed {args.seed}.
Batch {args.batch_size} x {args.seq_len} tokens, {s['steps']} of {args.steps} steps{s['ended_by']} ({s['steps'] * args.batch_size * args.seq_len:,} tokens,
{s['steps'] * args.batch_size * args.seq_len / s['train_tokens']:.1f} epochs), wall time {s['wall_s'] / 60:.1f} min.
Final training loss (mean of the last 50 steps) {s['final_loss']:.3f}; held-out loss {s['val_loss']:.3f}.

Greedy continuation of "{SAMPLE_PROMPT}":

> {s['sample'].replace(chr(10), ' / ')}

## Reproduce
```
{INSTALL_HINT}
{cmd}
```
Add `--out-dir DIR` to write elsewhere; a smaller `--steps` or `--time-budget-min` gives a quick run. The result
is reproducible (same torch build and CPU) when the step budget, not the time budget, ends training.
""")


def train_main_model(args, chapters, tok, stream, val_stream, gen):
    """The main model, written to --out-dir with its report; returned in fp32 with the weights as shipped."""
    dialogues = int((stream == tok.convert_tokens_to_ids(USER)).sum())
    cfg = model_config(len(tok.get_vocab()), tok)
    model = DeepseekV3ForCausalLM(cfg)
    params = sum(p.numel() for p in model.parameters())
    expert = 3 * cfg.hidden_size * cfg.moe_intermediate_size
    moe_layers = cfg.num_hidden_layers - cfg.first_k_dense_replace
    active = params - moe_layers * expert * (cfg.n_routed_experts - cfg.num_experts_per_tok)
    print(f"model: {params:,} parameters ({active:,} active per token)", flush=True)

    stats = train(model, stream, args, gen)
    stats["val_loss"] = eval_loss(model, val_stream, args.seq_len)
    stats["sample"] = greedy_sample(model, tok, SAMPLE_PROMPT)
    print(f"done: {stats['steps']} steps in {stats['wall_s'] / 60:.1f} min, loss {stats['final_loss']:.3f}, "
          f"val {stats['val_loss']:.3f}\nsample: {stats['sample']}", flush=True)

    save_checkpoint(model, tok, corpus_words(chapters), args.out_dir)
    all_text = [v for ch in chapters for v in ch.verses]
    stats.update(
        text_version=package_version(DEBIAN_PACKAGES[0]), reader_version=package_version(DEBIAN_PACKAGES[1]),
        chapters=len(chapters), verses=len(all_text), words=sum(len(v.split()) for v in all_text),
        chars=sum(len(v) for v in all_text), dialogues=dialogues, val_chapters=len(chapters[::50]),
        train_tokens=stream.numel(), val_tokens=val_stream.numel(), vocab=cfg.vocab_size, cfg=cfg,
        params=params, active_params=active, file_mb=(args.out_dir / "model.safetensors").stat().st_size / 1e6)
    write_report(args.out_dir, args, stats)
    return model.float()  # the MTP layer learns against the bf16-rounded weights that ship


def train_mtp_stage(model, stream, val_stream, args, gen) -> None:
    """Train the MTP layer over the frozen main model and add it to the checkpoint in --out-dir (also at each
    checkpoint, with its report)."""
    mtp = load_mtp_layer(model, args.out_dir) if args.mtp_resume else new_mtp_layer(model)
    print(f"mtp: {sum(p.numel() for p in mtp.parameters()):,} parameters", flush=True)
    main_val_loss = eval_loss(model, val_stream, args.seq_len)
    command = (f"nice -n 10 .venv/bin/python scripts/train_default_model.py --mtp-only --mtp-steps {args.mtp_steps} "
               f"--mtp-time-budget-min {args.mtp_time_budget_min:g} --mtp-lr {args.mtp_lr:g} "
               f"--mtp-loss-weight {args.mtp_loss_weight:g} --mtp-distill {args.mtp_distill:g} "
               f"--batch-size {args.batch_size} --seq-len {args.seq_len} --seed {args.seed}"
               + (" --mtp-resume" if args.mtp_resume else ""))

    def write(stats: dict) -> None:
        stats.update(eval_mtp(model, mtp, val_stream, args.seq_len))
        stats.update(layer_idx=model.config.num_hidden_layers, main_val_loss=main_val_loss,
                     mtp_params=sum(p.numel() for p in mtp.parameters()))
        print(f"mtp: {stats['mtp_steps']} steps in {stats['mtp_wall_s'] / 60:.1f} min, val ce "
              f"{stats['mtp_val_ce']:.3f}, agreement with the main model {stats['mtp_val_agreement']:.3f}", flush=True)
        stats["mtp_mb"] = save_mtp(mtp, model.config.num_hidden_layers, args.out_dir)
        stats["file_mb"] = (args.out_dir / "model.safetensors").stat().st_size / 1e6
        write_mtp_report(args.out_dir, args, stats, command)

    write(train_mtp(model, mtp, stream, args, gen, random_batch, ExpertLoadBalancer, checkpoint=write))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)  # the build machine's cores are shared
    torch.manual_seed(args.seed)
    gen = torch.Generator().manual_seed(args.seed)

    chapters = load_corpus()
    val_chapters = chapters[::50]
    train_chapters = [ch for i, ch in enumerate(chapters) if i % 50 != 0]
    if args.mtp_only:
        tok = PreTrainedTokenizerFast.from_pretrained(args.out_dir)
    else:
        tok = hf_tokenizer(train_tokenizer([chapter_text(ch) for ch in chapters], args.vocab_size))
    stream = build_stream(train_chapters, tok, gen)
    val_stream = torch.tensor(
        [t for ch in val_chapters for t in tok(chapter_text(ch), verbose=False)["input_ids"] + [tok.eos_token_id]])
    print(f"corpus: {len(chapters)} chapters; train stream {stream.numel():,} tokens, val {val_stream.numel():,}",
          flush=True)
    if args.mtp_only:
        model = DeepseekV3ForCausalLM.from_pretrained(args.out_dir, dtype=torch.float32)
    else:
        model = train_main_model(args, chapters, tok, stream, val_stream, gen)
    train_mtp_stage(model, stream, val_stream, args, gen)
    print(f"wrote {args.out_dir}", flush=True)


if __name__ == "__main__":
    main()
