"""KV-cache streaming (DéjàVuLib): flush/fetch chunks over transports, scatter/gather regions,
stream_out/stream_in between pipelines of different shapes, and overlap with compute."""
