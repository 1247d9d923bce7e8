"""transport/congestion layer of udpverbs."""
