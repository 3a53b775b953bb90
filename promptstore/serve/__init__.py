"""`promptstore serve`: an OpenAI-compatible server (mlx_lm.server's) whose
prompt cache is a PromptStore, so it survives restarts and is shared by every
process on the store."""

import sys


def main(argv=None) -> int:
    """Run `promptstore serve` with `argv` (default: sys.argv[1:])."""
    from ..errors import ServeConfigError

    try:
        from .server import main as serve
    except ServeConfigError as e:  # an mlx-lm outside the range serve was written for (mlx_lm_server.py)
        if "--debug" in (sys.argv[1:] if argv is None else argv):
            raise
        print(f"promptstore serve: error: {e}", file=sys.stderr)
        return 2
    return serve(argv)
