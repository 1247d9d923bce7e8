"""wire layer of udpverbs."""
