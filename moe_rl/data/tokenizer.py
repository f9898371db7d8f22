"""The built-in demo model's tokenizer: characters plus ``\\boxed{`` as one token, as a
real Hugging Face fast tokenizer (saved with the model, loadable by AutoTokenizer), with a
chat template that renders the last user message as it is (the built-in model knows no
roles: it was warm-started on bare ``a+b=`` prompts), so chat-format datasets (verl's)
run on it with ``data.chat_template=true``."""

from __future__ import annotations

from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIAL = ["<pad>", "<eos>"]
REVISION = 2  # part of the built-in model's cache key: 2 added the chat template
CHAT_TEMPLATE = (
    "{%- set users = messages | selectattr('role', 'equalto', 'user') | list -%}"
    "{{- (users[-1] if users else messages[-1])['content'] -}}"
)
PIECES = ["\\boxed{"] + list("0123456789+-*=(){}?., :abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ")


def demo_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {tok: i for i, tok in enumerate(SPECIAL + PIECES)}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="?"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex(r"\\boxed\{|."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="?")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def vocab_size() -> int:
    return len(SPECIAL) + len(PIECES)
