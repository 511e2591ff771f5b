"""The multi-token-prediction (MTP) stage of `train_default_model.py`: one MTP layer over a frozen main model.

DeepSeek-V3 report, section 2.2: for position i the MTP module combines the main model's output h_i (after its
final norm) with the embedding of token i+1, zeroed at position 0, `eh_proj([enorm(embed(t_{i+1})); hnorm(h_i)])`
(vLLM's inputs to DeepSeek-V3's MTP layer, which latentserve's engine gives it: docs/speculative_decoding.md), runs
one decoder layer over that sequence (causal attention, its own KV), and predicts t_{i+2} through the shared output
head after its own norm (`shared_head.norm`).
The loss is `lambda * mean_i [(1 - a) CE(t_{i+2}) + a KL(main || MTP)]`: the report's loss (one MTP depth) at
a = 0; a > 0 adds distillation from the frozen main model's own prediction of t_{i+2}, which is what a draft
must match to be accepted.
"""
from __future__ import annotations

import json
import math
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3DecoderLayer, DeepseekV3RMSNorm


class MTPLayer(nn.Module):
    """One MTP module; embedding and output head are borrowed from the main model at call time."""

    def __init__(self, cfg, layer_idx: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.enorm = DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.hnorm = DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * h, h, bias=False)
        self.block = DeepseekV3DecoderLayer(cfg, layer_idx)  # MoE by first_k_dense_replace, as DeepSeek builds it
        self.shared_head_norm = DeepseekV3RMSNorm(h, eps=cfg.rms_norm_eps)

    def forward(self, main, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor:
        """hidden `[B, S, H]` (h_0..h_{S-1}), next_ids `[B, S]` (t_1..t_S) -> logits `[B, S, V]` for t_2..t_{S+1}.
        The embedding at position 0 is zeroed, as vLLM feeds DeepSeek's MTP layers (docs/speculative_decoding.md)."""
        embeds = main.model.embed_tokens(next_ids)
        embeds = torch.cat([torch.zeros_like(embeds[:, :1]), embeds[:, 1:]], dim=1)
        x = self.eh_proj(torch.cat([self.enorm(embeds), self.hnorm(hidden)], dim=-1))
        n = x.shape[1]
        positions = torch.arange(n)[None]
        mask = torch.full((n, n), float("-inf")).triu(1)[None, None]
        x = self.block(x, attention_mask=mask, position_ids=positions,
                       position_embeddings=main.model.rotary_emb(x, positions))
        return main.lm_head(self.shared_head_norm(x))


def new_mtp_layer(main) -> MTPLayer:
    """An MTP layer whose decoder block starts as a copy of the main model's last layer (same shapes: both MoE)."""
    cfg = main.config
    mtp = MTPLayer(cfg, cfg.num_hidden_layers)
    mtp.block.load_state_dict(main.model.layers[-1].state_dict())
    mtp.shared_head_norm.weight.data.copy_(main.model.norm.weight.data)
    nn.init.normal_(mtp.eh_proj.weight, std=cfg.initializer_range)
    return mtp


def load_mtp_layer(main, out_dir: Path) -> MTPLayer:
    """The MTP layer stored in `out_dir`'s `model.safetensors` (as `mtp_state_dict` writes it), in fp32: a warm
    start for more training."""
    cfg = main.config
    prefix = f"model.layers.{cfg.num_hidden_layers}."
    stored = {k[len(prefix):]: v.float() for k, v in load_file(out_dir / "model.safetensors").items()
              if k.startswith(prefix)}
    if not stored:
        raise SystemExit(f"error: {out_dir}/model.safetensors has no MTP layer ('{prefix}*') to resume from")
    experts = range(cfg.n_routed_experts)
    block = {k: v for k, v in stored.items() if ".experts." not in k and not k.startswith(
        ("enorm.", "hnorm.", "eh_proj.", "shared_head."))}
    block["mlp.experts.gate_up_proj"] = torch.stack([torch.cat(
        [stored.pop(f"mlp.experts.{e}.{p}_proj.weight") for p in ("gate", "up")]) for e in experts])
    block["mlp.experts.down_proj"] = torch.stack([stored.pop(f"mlp.experts.{e}.down_proj.weight") for e in experts])
    mtp = MTPLayer(cfg, cfg.num_hidden_layers)
    mtp.block.load_state_dict(block)
    for name, module in (("enorm", mtp.enorm), ("hnorm", mtp.hnorm), ("eh_proj", mtp.eh_proj),
                         ("shared_head.norm", mtp.shared_head_norm)):
        module.weight.data.copy_(stored[f"{name}.weight"])
    return mtp


@torch.no_grad()
def main_hidden(main, ids: torch.Tensor) -> torch.Tensor:
    """The main model's output hidden states (after its final norm), `[B, S, H]`."""
    return main.model(input_ids=ids).last_hidden_state


def mtp_loss(main, mtp: MTPLayer, window: torch.Tensor, distill: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(loss, CE of t_{i+2}) over a `[B, S+1]` window: main sees t_0..t_{S-1}; MTP position i gets (h_i, t_{i+1})."""
    hidden = main_hidden(main, window[:, :-1])
    logits = mtp(main, hidden[:, :-1], window[:, 1:-1]).flatten(0, 1)
    ce = F.cross_entropy(logits, window[:, 2:].flatten())
    if not distill:
        return ce, ce
    with torch.no_grad():  # main's distribution of t_{i+2}, from t_0..t_{i+1}
        target = F.log_softmax(main.lm_head(hidden[:, 1:]).flatten(0, 1), dim=-1)
    kl = F.kl_div(F.log_softmax(logits, dim=-1), target, log_target=True, reduction="batchmean")
    return (1 - distill) * ce + distill * kl, ce


def _lr_at(progress: float, peak: float, warmup: float = 0.03) -> float:
    if progress < warmup:
        return peak * progress / warmup
    return peak * (0.1 + 0.45 * (1 + math.cos(math.pi * min(1.0, (progress - warmup) / (1 - warmup)))))


def train_mtp(main, mtp: MTPLayer, stream, args, gen, random_batch, balancer_cls, checkpoint=None) -> dict:
    """AdamW on the MTP layer only; `lambda * CE` is the V3 report's MTP loss (main frozen, so lambda scales it).
    `checkpoint(step)` runs every `--mtp-save-every` steps, so an interrupted run still leaves a trained layer."""
    main.eval()
    for p in main.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(mtp.parameters(), lr=args.mtp_lr, betas=(0.9, 0.95), weight_decay=0.1)
    balancer = balancer_cls(mtp, rate=1e-3)
    budget_s = args.mtp_time_budget_min * 60
    start, recent, step = time.time(), [], 0
    mtp.train()
    while step < args.mtp_steps and time.time() - start < budget_s:
        # The schedule runs out with the step budget or the time budget, whichever comes first: a run the clock
        # ends still anneals its learning rate.
        progress = max(step / args.mtp_steps, (time.time() - start) / budget_s)
        for group in opt.param_groups:
            group["lr"] = _lr_at(progress, args.mtp_lr)
        loss, ce = mtp_loss(main, mtp, random_batch(stream, args.batch_size, args.seq_len, gen), args.mtp_distill)
        (args.mtp_loss_weight * loss).backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        imbalance = balancer.step()
        step += 1
        recent = (recent + [ce.item()])[-50:]
        if step % args.log_every == 0 or step == 1:
            print(f"mtp step {step:5d}  ce {ce.item():.3f}  avg50 {sum(recent) / len(recent):.3f}  "
                  f"max/mean expert load {imbalance:.2f}  elapsed {time.time() - start:6.0f}s", flush=True)
        if checkpoint is not None and step % args.mtp_save_every == 0 and step < args.mtp_steps:
            checkpoint(_train_stats(step, start, recent, " (a checkpoint of a run still going)"))
            mtp.train()
    ended_by = "" if step == args.mtp_steps else " (the time budget ended training)"
    return _train_stats(step, start, recent, ended_by)


def _train_stats(step: int, start: float, recent: list[float], ended_by: str) -> dict:
    return {"mtp_steps": step, "mtp_wall_s": time.time() - start, "mtp_final_ce": sum(recent) / len(recent),
            "mtp_ended_by": ended_by}


@torch.no_grad()
def eval_mtp(main, mtp: MTPLayer, stream: torch.Tensor, seq_len: int) -> dict:
    """Held-out MTP CE, and how often the MTP's argmax for t_{i+2} equals the main model's (teacher-forced)."""
    mtp.eval()
    windows = stream[: stream.numel() // (seq_len + 1) * (seq_len + 1)].view(-1, seq_len + 1)
    ce, agree, count = 0.0, 0, 0
    for w in windows:
        w = w[None]
        hidden = main_hidden(main, w[:, :-1])
        draft = mtp(main, hidden[:, :-1], w[:, 1:-1])
        target = main.lm_head(hidden[:, 1:])  # main's prediction of t_{i+2} from t_0..t_{i+1}
        ce += F.cross_entropy(draft[0], w[0, 2:], reduction="sum").item()
        agree += int((draft.argmax(-1) == target.argmax(-1)).sum())
        count += draft.shape[1]
    mtp.train()
    return {"mtp_val_ce": ce / count, "mtp_val_agreement": agree / count}


def mtp_state_dict(mtp: MTPLayer, layer_idx: int) -> dict[str, torch.Tensor]:
    """Checkpoint names and layout (per-expert tensors, as DeepSeek stores them); bf16 except the router."""
    prefix = f"model.layers.{layer_idx}."
    out = {prefix + "enorm.weight": mtp.enorm.weight, prefix + "hnorm.weight": mtp.hnorm.weight,
           prefix + "eh_proj.weight": mtp.eh_proj.weight,
           prefix + "shared_head.norm.weight": mtp.shared_head_norm.weight}
    for name, tensor in mtp.block.state_dict().items():
        if name == "mlp.experts.gate_up_proj":
            for e, fused in enumerate(tensor):
                gate, up = fused.chunk(2, dim=0)
                out[f"{prefix}mlp.experts.{e}.gate_proj.weight"] = gate
                out[f"{prefix}mlp.experts.{e}.up_proj.weight"] = up
        elif name == "mlp.experts.down_proj":
            for e, down in enumerate(tensor):
                out[f"{prefix}mlp.experts.{e}.down_proj.weight"] = down
        else:
            out[prefix + name] = tensor
    router = (f"{prefix}mlp.gate.weight", f"{prefix}mlp.gate.e_score_correction_bias")
    return {k: v.detach().to(torch.float32 if k in router else torch.bfloat16).contiguous() for k, v in out.items()}


def save_mtp(mtp: MTPLayer, layer_idx: int, out_dir: Path) -> float:
    """Add (or replace) the MTP tensors in `model.safetensors` and declare the layer in config.json; returns the
    MTP tensors' size in MB."""
    weights_path = out_dir / "model.safetensors"
    prefix = f"model.layers.{layer_idx}."
    tensors = {k: v for k, v in load_file(weights_path).items() if not k.startswith(prefix)}
    tensors.update(mtp_state_dict(mtp, layer_idx))
    save_file(tensors, weights_path, metadata={"format": "pt"})
    weights_path.chmod(0o644)
    config_path = out_dir / "config.json"
    config = json.loads(config_path.read_text())
    config["num_nextn_predict_layers"] = 1
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
    return sum(t.numel() * t.element_size() for k, t in tensors.items() if k.startswith(prefix)) / 1e6


MTP_HEADING = "## MTP layer"


def write_mtp_report(out_dir: Path, args, stats: dict, command: str) -> None:
    """Replace (or append) the MTP section at the end of TRAINING.md."""
    path = out_dir / "TRAINING.md"
    text = path.read_text() if path.is_file() else ""
    text = text.split("\n" + MTP_HEADING)[0].rstrip("\n") + "\n"
    s = stats
    tokens = s["mtp_steps"] * args.batch_size * args.seq_len
    start = ("Training resumed from the MTP layer the checkpoint held before (`--mtp-resume`; that layer's own\n"
             "run is in this file's history)." if args.mtp_resume else "The decoder layer started as a copy of the "
             "main model's last layer,\n`shared_head.norm` as its final norm.")
    path.write_text(text + f"""
{MTP_HEADING}
One multi-token-prediction module (DeepSeek-V3 report, section 2.2), for speculative decoding:
`model.layers.{s['layer_idx']}.*` holds `enorm`, `hnorm`, `eh_proj` (over `[enorm(embed(t_(i+1))); hnorm(h_i)]`,
h_i the main model's output after its final norm, the embedding zeroed at position 0, as vLLM feeds DeepSeek-V3's
MTP layer: docs/speculative_decoding.md), one
decoder layer (MoE, like the main layers past `first_k_dense_replace`) and `shared_head.norm`; it has no
`embed_tokens` or `shared_head.head` of its own: it uses the main model's embedding and `lm_head` (DeepSeek-V3
shares them too), so tokens appended to the vocabulary later reach both. {s['mtp_params']:,} parameters of its own
(bf16, router in fp32), {s['mtp_mb']:.1f} MB of `model.safetensors` ({s['file_mb']:.1f} MB in all).

Trained with the main model frozen (bf16 weights as shipped, run in fp32): loss
`lambda * ((1 - a) CE(t_(i+2)) + a KL(main || MTP))` with lambda {args.mtp_loss_weight:g} (the report's value for
its first 10T tokens; with the main model frozen it only scales the gradient) and a = {args.mtp_distill:g}: besides
the report's loss (a = 0), distillation from the main model's own distribution of t_(i+2) given t_0..t_(i+1),
which a draft must match to be accepted.
{start}
AdamW (0.9/0.95, weight decay 0.1, clip 1.0), peak LR {args.mtp_lr:g}, warmup then cosine to the step or time budget,
whichever ends first, one thread, batch {args.batch_size} x {args.seq_len}, {s['mtp_steps']} of {args.mtp_steps} steps{s['mtp_ended_by']}
({tokens:,} tokens), wall time {s['mtp_wall_s'] / 60:.1f} min. Final training CE (mean of the last 50 steps)
{s['mtp_final_ce']:.3f}; held-out CE {s['mtp_val_ce']:.3f} (the main model's next-token loss there:
{s['main_val_loss']:.3f}). On the held-out chapters, teacher-forced, the MTP's argmax for t_(i+2) equals the main
model's in {100 * s['mtp_val_agreement']:.1f} % of positions (the greedy acceptance rate of the first draft token).

```
{command}
```
""")
