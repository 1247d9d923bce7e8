"""udpverbs: RDMA verbs over plain UDP.

Layers (each may import only the ones to its left):
``wire`` <- ``transport`` <- ``daemon``; ``wire`` <- ``verbs``; ``verbs`` <- ``bench``.
"""

__version__ = "0.1.0"
