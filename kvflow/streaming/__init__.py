"""KV-cache streaming (DéjàVuLib): flush/fetch chunks over transports, scatter/gather regions,
plan_transfers/stream_out between pipelines of different shapes, the KV connector (KVSender,
KVReceiver), and the executor sides of the prefix cache's tiers and of microbatch swapping."""
