package worker

import (
	"testing"

	"github.com/stretchr/testify/assert"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// TestCacheSubDropsWhenFull: push never blocks; the report that does not
// fit drops the subscriber, whose queue keeps what it held.
func TestCacheSubDropsWhenFull(t *testing.T) {
	c := newCacheSub(2)
	for i := range 3 {
		c.push(&stagepb.KvEvents{Seq: uint64(i + 1)})
	}
	select {
	case <-c.dropped:
	default:
		t.Fatal("a full queue did not drop the subscriber")
	}
	c.push(&stagepb.KvEvents{Seq: 4}) // dropped already: still does not block
	assert.Len(t, c.ch, 2)
}
