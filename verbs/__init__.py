"""verbs layer of udpverbs."""
