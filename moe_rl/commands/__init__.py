"""Sub-commands of the ``moe-rl`` command line, one module each."""


def configure_logging() -> None:
    """INFO to stderr with timestamps; the libraries' chatter (math-verify's notice on every
    call, megatron's and httpx's INFO) only from ERROR up."""
    import logging
    import sys

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s", stream=sys.stderr)
    for noisy in ("megatron", "math_verify", "httpx", "torch.distributed"):
        logging.getLogger(noisy).setLevel(logging.ERROR)
