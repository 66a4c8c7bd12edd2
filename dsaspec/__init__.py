"""dsaspec: decode-step costs of speculative decoding on DSA models that follow the live work.

Layers (imports only point down): ``flags`` → ``ops`` / ``reference`` → ``distributed`` →
``attention`` / ``spec`` → ``runtime`` → ``bench`` / ``cli``. See docs/ and design/ARCHITECTURE.md.
"""

__version__ = "0.1.0"
