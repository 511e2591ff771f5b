"""Model building blocks: norms, rotary embeddings, MLPs and mixture-of-experts."""
