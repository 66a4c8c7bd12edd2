"""DSA attention: the MLA layer with its indexer, the DSA ops it dispatches to, its inputs, and the attention backend that writes the replay metadata and builds those inputs."""
