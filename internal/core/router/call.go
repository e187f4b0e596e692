package router

import (
	"context"
	"time"

	"google.golang.org/grpc"

	"github.com/troupe-serving/troupe/pkg/stagepb"
)

// Call is one attempt on a picked replica, from Begin to Done, in the
// manner of grpc-go's balancer.PickResult: it holds the replica's slot,
// lets Replica.Abort cancel the attempt, counts it for a deadline policy,
// and takes its outcome back exactly once, through Done. The attempt
// reads the router through nothing else.
type Call struct {
	rt      *Router
	rep     *Replica
	probe   bool
	pending *Pending // nil unless the stage routes by deadline
	untrack func()
}

// Begin starts an attempt on d's replica. abort cancels the attempt when
// the replica is aborted (it left or froze). awaitsInput says the
// attempt's input does not exist yet (a fed stage before its first
// piece): it queues on the replica only from InputSent. The caller must
// call Done. Safe for concurrent use.
func (rt *Router) Begin(d Decision, awaitsInput bool, abort context.CancelCauseFunc) *Call {
	c := &Call{rt: rt, rep: d.Replica, probe: d.Probe}
	if awaitsInput {
		c.pending = rt.AwaitInput(c.rep)
	} else {
		c.pending = rt.StartFirstOutput(c.rep) // before the slot: it queues behind the others
	}
	c.rep.Acquire()
	c.untrack = c.rep.Track(abort)
	return c
}

// InputSent records that the attempt's first input piece reached the
// replica. Safe for concurrent use with FirstOutput and Done.
func (c *Call) InputSent() { c.pending.InputSent() }

// FirstOutput records that the attempt's first output reached the head:
// it no longer waits on the replica.
func (c *Call) FirstOutput() { c.pending.Done() }

// Alive is when the replica last showed this head that it works, on any
// of its attempts (the latest load report a chunk brought).
func (c *Call) Alive() time.Time { return c.rep.HeardAt() }

// Answers reports whether the replica answers Health within d, and counts
// an answer as a sign of life (Alive) for every attempt on it: a replica
// busy with a queue or a long prefill answers, a frozen one does not.
func (c *Call) Answers(ctx context.Context, d time.Duration, opts ...grpc.CallOption) bool {
	ctx, cancel := context.WithTimeout(ctx, d)
	defer cancel()
	if _, err := c.rep.Client.Health(ctx, &stagepb.HealthRequest{}, opts...); err != nil {
		return false
	}
	c.rep.heardAt.Store(time.Now().UnixNano())
	return true
}

// Chunk applies what one of the attempt's chunks tells of the replica:
// its cache report to the stage's prefix index, its load to the replica.
func (c *Call) Chunk(chunk *stagepb.GenerateChunk) {
	if ev := chunk.GetKvEvents(); ev != nil {
		c.rt.ApplyKVEvents(c.rep, ev)
	}
	if s := chunk.GetStats(); s != nil {
		c.rep.SetLoadFrom(s)
	}
}

// ObserveRate hands a deadline policy the attempt's audio rate when the
// attempt is moved for falling behind real time, before it ends.
func (c *Call) ObserveRate(rtf float64) { c.rt.ObserveRate(c.rep, rtf) }

// Outcome is how an attempt ended, as its Call's Done takes it.
type Outcome struct {
	Err   error // nil: the attempt succeeded
	Fault bool  // Err was the replica's doing: it counts towards the breaker
	// Draining: the replica refused the call because it drains; no
	// request routes to it again.
	Draining bool
	// Elapsed is the whole attempt, from Begin.
	Elapsed time.Duration
	// FirstOutput is when, after Begin, the first output reached the head;
	// 0 when none did. With PastTarget and no first output, the attempt
	// ended at its deadline and Elapsed is learned in its place: its
	// first output would have come later.
	FirstOutput time.Duration
	PastTarget  bool
	// AudioRate is audio seconds per wall second after the first output;
	// 0: no audio.
	AudioRate float64
}

// Report is what Done tells the attempt's owner to log and count.
type Report struct {
	Recovered bool // an ejected replica succeeded: it routes again
	Ejection       // of a failure (zero on success or a failure not the replica's)
}

// Done ends the attempt: a deadline policy learns from it, the breaker
// counts it, and the replica's slot and tracking are released. Call it
// exactly once.
func (c *Call) Done(o Outcome) Report {
	c.learn(o)
	var rep Report
	switch {
	case o.Err == nil:
		rep.Recovered = c.rt.RecordSuccess(c.rep)
	case o.Fault:
		rep.Ejection = c.rt.RecordFailure(c.rep)
	}
	if o.Draining {
		c.rep.MarkDraining()
	}
	c.untrack()
	c.rep.Release()
	c.pending.Done()
	return rep
}

// learn hands a deadline policy the replica's own times: first output
// less the wait for input, how long it held its slot, its audio rate.
func (c *Call) learn(o Outcome) {
	if c.pending == nil {
		return
	}
	switch {
	case o.FirstOutput > 0:
		c.rt.ObserveFirstOutput(c.pending, o.FirstOutput)
	case o.PastTarget:
		c.rt.ObserveFirstOutput(c.pending, o.Elapsed)
	}
	if lead, ok := c.pending.Lead(); ok {
		c.rt.ObserveHold(c.rep, o.Elapsed-lead)
	} else if c.probe {
		c.rt.ReleaseProbe(c.rep) // it never reached the replica
	}
	if o.AudioRate > 0 {
		c.rt.ObserveRate(c.rep, o.AudioRate)
	}
}
