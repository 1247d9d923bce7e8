"""transport layer of udpverbs."""
