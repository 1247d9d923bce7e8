"""daemon layer of udpverbs."""
