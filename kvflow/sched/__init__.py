"""The one scheduling core: requests, sampling parameters, and the Scheduler every executor runs."""
