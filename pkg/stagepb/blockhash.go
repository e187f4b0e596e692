package stagepb

// BlockHash is the hash of one full KV block of token ids given the hash of
// the block before it (0 for the first block), so that equal hashes mean
// equal prefixes, not just equal blocks. It is the protocol's definition:
// an engine that reports KvEvents names its blocks with it, and the head
// hashes a prompt the same way to look them up.
func BlockHash(parent uint64, tokens []uint32) uint64 {
	h := mix(parent ^ 0x626c6f636b)
	for _, t := range tokens {
		h = mix(h ^ uint64(t))
	}
	return h
}

// BlockHashes returns the chained hashes of every full block of blockSize
// tokens (a partial last block has none). blockSize <= 0 gives nil.
func BlockHashes(tokens []uint32, blockSize int) []uint64 {
	if blockSize <= 0 {
		return nil
	}
	out := make([]uint64, 0, len(tokens)/blockSize)
	var parent uint64
	for j := 0; (j+1)*blockSize <= len(tokens); j++ {
		parent = BlockHash(parent, tokens[j*blockSize:(j+1)*blockSize])
		out = append(out, parent)
	}
	return out
}

// mix is the splitmix64 finalizer: a cheap, well-spread 64-bit hash.
func mix(z uint64) uint64 {
	z += 0x9e3779b97f4a7c15
	z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9
	z = (z ^ (z >> 27)) * 0x94d049bb133111eb
	return z ^ (z >> 31)
}
