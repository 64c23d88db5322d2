"""Many kvflow instances as one service: the router (`kvflow router`), its instance pool and placement policies."""
