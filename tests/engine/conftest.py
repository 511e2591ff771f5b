import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

CORPUS = [
    "the quick brown fox jumps over the lazy dog",
    "hello world, hello engine, hello latent attention",
    "stop here. then go on: the end",
    "café crème brûlée naïve façade",
] * 20


@pytest.fixture(scope="session")
def tiny_tokenizer() -> Tokenizer:
    """A byte-level BPE trained in memory: small enough that accents, CJK and emoji split across tokens."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<s>", "</s>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(CORPUS, trainer)
    return tokenizer
