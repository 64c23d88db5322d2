"""The controller: admission, microbatch formation, pipelines of worker processes, token collection, failure detection."""
