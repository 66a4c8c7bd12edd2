"""Pure-PyTorch definitions of every op: the spec the tests compare against."""
