"""Getting weights onto the nodes that run them: sources (Hub, S3, shared folders), listings,
each node's cache, and the fetch that fills it. Pure code and clients: no Ray import here."""
