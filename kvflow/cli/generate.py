"""`kvflow generate` and `kvflow chat` (filled in by the engine)."""


def register(sub) -> None:
    pass
