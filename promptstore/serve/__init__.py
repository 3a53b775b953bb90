"""`promptstore serve`: an OpenAI-compatible server (mlx_lm.server's) whose
prompt cache is a PromptStore, so it survives restarts and is shared by every
process on the store."""


def main(argv=None) -> int:
    """Run `promptstore serve` with `argv` (default: sys.argv[1:])."""
    from .server import main as serve

    return serve(argv)
