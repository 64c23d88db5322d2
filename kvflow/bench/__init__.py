"""`kvflow bench serve`: an open-loop load generator for the OpenAI-compatible server."""
