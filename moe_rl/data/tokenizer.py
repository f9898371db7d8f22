"""The built-in demo model's tokenizer: characters plus ``\\boxed{`` as one token, as a
real Hugging Face fast tokenizer (saved with the model, loadable by AutoTokenizer)."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<eos>"]
PIECES = ["\\boxed{"] + list("0123456789+-*=(){}?., :abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def demo_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + PIECES)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\\boxed\{|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="?")
    return fast


def vocab_size() -> int:
    return len(SPECIAL) + len(PIECES)
