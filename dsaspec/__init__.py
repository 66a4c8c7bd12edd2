"""dsaspec: decode-step costs of speculative decoding on DSA models that follow the live work.

Layers (imports only point down): ``flags`` → ``ops`` → ``distributed`` → ``attention`` /
``speculative`` → ``runtime`` → ``bench`` / ``cli``; ``reference`` (the tests' oracle) imports
nothing of the package. See docs/.
"""

__version__ = "0.1.0"
