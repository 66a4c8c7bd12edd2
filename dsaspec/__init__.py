"""dsaspec: decode-step costs of speculative decoding on DSA models that follow the live work.

Layers (imports only point down): ``errors`` / ``flags`` / ``cli_parsing`` → ``configs`` → ``ops`` →
``distributed`` → ``layers`` → ``memory`` → ``models`` → ``executor`` → ``speculative`` → ``engine`` →
``bench`` / ``commands``; ``reference`` (the tests' oracle) imports nothing of the package. See
docs/architecture.md.
"""

__version__ = "0.1.0"
