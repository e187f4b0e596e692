package sim

import (
	"container/list"

	"github.com/troupe-serving/troupe/pkg/stagepb"
	"github.com/troupe-serving/troupe/pkg/tokenizers"
)

// mediaItem is one media part of a request as the encoder sees it: its
// content hash (tokenizers.MediaHash) and size.
type mediaItem struct {
	hash  uint64
	bytes int
}

// mediaItemsOf lists the media parts of msgs, in order.
func mediaItemsOf(msgs []*stagepb.ChatMessage) []mediaItem {
	var items []mediaItem
	for _, m := range msgs {
		for _, p := range m.GetParts() {
			if p.GetKind() != stagepb.PartText {
				items = append(items, mediaItem{hash: tokenizers.MediaHash(p), bytes: len(p.GetData())})
			}
		}
	}
	return items
}

// encoderCache is the sim's multimodal encoder cache, like vLLM's: the
// encoder outputs of the last Config.EncoderCacheEntries media parts by
// content hash, least recently used evicted first. A part found there is
// not encoded again. It belongs to the engine loop (no locks).
type encoderCache struct {
	capacity int
	order    *list.List // of uint64, most recently used first
	byHash   map[uint64]*list.Element
}

func newEncoderCache(capacity int) *encoderCache {
	return &encoderCache{capacity: capacity, order: list.New(), byHash: map[uint64]*list.Element{}}
}

// lookup reports whether hash is cached, and caches it (most recently
// used) either way, evicting the least recently used past capacity.
func (c *encoderCache) lookup(hash uint64) (hit bool) {
	if e, ok := c.byHash[hash]; ok {
		c.order.MoveToFront(e)
		return true
	}
	c.byHash[hash] = c.order.PushFront(hash)
	if c.order.Len() > c.capacity {
		last := c.order.Back()
		c.order.Remove(last)
		delete(c.byHash, last.Value.(uint64))
	}
	return false
}

// clear empties the cache (sleep level 2 discards the GPU's caches).
func (c *encoderCache) clear() {
	c.order.Init()
	clear(c.byHash)
}
