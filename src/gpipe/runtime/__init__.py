"""The runtime: stage workers running their action lists, and the transports between them."""
