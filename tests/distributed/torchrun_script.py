"""Run by test_dp.py under `torchrun --nproc-per-node 2`: every rank makes the same LLM and generate call."""
import json
import sys

import torch

from latentserve import LLM, SamplingParams

torch.set_num_threads(1)
model, prompts_json, out_path, config_json = sys.argv[1:5]
llm = LLM(model=model, data_parallel_size=2, enable_expert_parallel=True, **json.loads(config_json))
outputs = llm.generate(json.loads(prompts_json), SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True,
                                                                prompt_logprobs=0))
rank = llm.dp_engine.group.rank
with open(f"{out_path}.{rank}", "w") as f:
    json.dump([[o.outputs[0].token_ids, [{t: lp.logprob for t, lp in entry.items()} for entry in o.prompt_logprobs[1:]]]
               for o in outputs], f)
llm.shutdown()
