"""Give the embedded model DeepSeek's think and tool-call tokens: appended as new ids to tokenizer.json, with rows
appended to every vocabulary-sized weight (embedding, lm_head, an MTP layer's copies) and config.json's vocab_size.

Idempotent: run it again after replacing model.safetensors (it adds only what is missing).
    python scripts/add_special_tokens.py [model_dir]
"""
from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

DEFAULT_DIR = Path(__file__).resolve().parents[1] / "latentserve" / "assets" / "default_model"
# DeepSeek-R1's and DeepSeek-V3's spellings. Not "special": they stay in decoded text, where the parsers find them.
NEW_TOKENS = [
    "<think>", "</think>",
    "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>",
    "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>", "<｜tool▁output▁end｜>",
]


# DeepSeek-V3's layout: tools described after the system prompt, calls after the assistant's text, results between
# tool-output markers; a past assistant turn keeps only its answer (the text after </think>), as DeepSeek-R1's.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for m in messages if m['role'] == 'system' %}{{ m['content'] + '\\n\\n' }}{% endfor %}"
    "{% if tools %}{{ '## Tools\\n' }}"
    "{% for tool in tools %}{{ '\\n### ' + tool['function']['name'] + '\\n' }}"
    "{% if tool['function']['description'] %}{{ tool['function']['description'] + '\\n' }}{% endif %}"
    "{{ '```json\\n' + (tool['function']['parameters'] or {}) | tojson + '\\n```\\n' }}{% endfor %}"
    "{{ '\\n' }}{% endif %}"
    "{% set ns = namespace(in_outputs=false) %}"
    "{% for m in messages %}"
    "{% if m['role'] != 'tool' and ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% set ns.in_outputs = false %}{% endif %}"
    "{% if m['role'] == 'user' %}{{ '<|User|>' + m['content'] }}"
    "{% elif m['role'] == 'assistant' %}{{ '<|Assistant|>' + (m['content'] or '').split('</think>')[-1] }}"
    "{% if m['tool_calls'] %}{{ '<｜tool▁calls▁begin｜>' }}{% for call in m['tool_calls'] %}"
    "{{ '<｜tool▁call▁begin｜>' + call['type'] + '<｜tool▁sep｜>' + call['function']['name'] + '\\n```json\\n' "
    "+ call['function']['arguments'] + '\\n```<｜tool▁call▁end｜>' }}{% endfor %}{{ '<｜tool▁calls▁end｜>' }}{% endif %}"
    "{{ eos_token }}"
    "{% elif m['role'] == 'tool' %}{% if not ns.in_outputs %}{{ '<｜tool▁outputs▁begin｜>' }}"
    "{% set ns.in_outputs = true %}{% endif %}{{ '<｜tool▁output▁begin｜>' + m['content'] + '<｜tool▁output▁end｜>' }}"
    "{% elif m['role'] != 'system' %}{{ raise_exception('unsupported chat role: ' + m['role']) }}{% endif %}"
    "{% endfor %}"
    "{% if ns.in_outputs %}{{ '<｜tool▁outputs▁end｜>' }}{% endif %}"
    "{% if add_generation_prompt %}{{ '<|Assistant|>' }}{% endif %}"
)


def add_tokens(tokenizer_path: Path) -> int:
    """Append the missing tokens; returns the vocabulary size after."""
    data = json.loads(tokenizer_path.read_text())
    vocab_size = len(data["model"]["vocab"]) + sum(1 for t in data["added_tokens"] if t["content"] not in data["model"]["vocab"])
    present = {t["content"] for t in data["added_tokens"]}
    for token in NEW_TOKENS:
        if token not in present:
            data["added_tokens"].append({"id": vocab_size, "content": token, "single_word": False, "lstrip": False,
                                         "rstrip": False, "normalized": False, "special": False})
            vocab_size += 1
    tokenizer_path.write_text(json.dumps(data, ensure_ascii=False, indent=2))
    return vocab_size


def extend_weights(weights_path: Path, old_size: int, new_size: int) -> None:
    """New rows: the mean embedding, and an lm_head row at the mean logit (the model does not pick them unasked)."""
    tensors = load_file(str(weights_path))
    changed = False
    for name, tensor in tensors.items():
        if tensor.dim() == 2 and tensor.shape[0] == old_size and name.endswith(("embed_tokens.weight", "head.weight")):
            extra = tensor.float().mean(dim=0, keepdim=True).expand(new_size - old_size, -1).to(tensor.dtype)
            tensors[name] = torch.cat([tensor, extra]).contiguous()
            changed = True
    if changed:
        save_file(tensors, str(weights_path), metadata={"format": "pt"})


def main(model_dir: Path) -> None:
    config_path = model_dir / "config.json"
    config = json.loads(config_path.read_text())
    new_size = add_tokens(model_dir / "tokenizer.json")
    extend_weights(model_dir / "model.safetensors", config["vocab_size"], new_size)
    config["vocab_size"] = new_size
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    tokenizer_config_path = model_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(tokenizer_config_path.read_text())
    tokenizer_config["chat_template"] = CHAT_TEMPLATE
    tokenizer_config_path.write_text(json.dumps(tokenizer_config, ensure_ascii=False, indent=2) + "\n")
    print(f"{model_dir}: vocab_size {new_size}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else DEFAULT_DIR)
