"""bench layer of udpverbs."""
