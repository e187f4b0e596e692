package orchestrator

import (
	"bytes"
	"errors"
	"fmt"
	"os"
	"slices"

	"gopkg.in/yaml.v3"

	"github.com/troupe-serving/troupe/internal/core/router"
)

// Pipeline is the model and its ordered stages, from the pipeline file.
type Pipeline struct {
	Model  string  `yaml:"model"`
	Stages []Stage `yaml:"stages"`
	// Streaming forwards each stage's output to the next stage while it is
	// still generating (the default). false runs the stages one after the
	// other, each on its whole input: slower to the first audio, kept to
	// compare against.
	Streaming *bool `yaml:"streaming,omitempty"`
	// Deadline holds the targets of every stage that names none
	// (docs/routing.md, Deadline-aware routing); its capacity and
	// admission keys are per stage.
	Deadline *Deadline `yaml:"deadline,omitempty"`
}

// Stage is one step of the pipeline. Only Name is required.
type Stage struct {
	Name string `yaml:"name"`
	// InputChunk is how many input units (words of text, or codes) the
	// stage gathers from the previous stage before it starts a segment of
	// work, when the pipeline streams. 0: the worker's default (8 words,
	// 10 codes).
	InputChunk int `yaml:"input_chunk,omitempty"`
	// Policy routes the stage's requests: round_robin, least_loaded,
	// power_of_two, prefix_aware or deadline. Empty: the head's default (--policy).
	Policy string `yaml:"policy,omitempty"`
	// PrefixSource is where prefix_aware learns what each replica caches:
	// auto (default: what the engine reports, where it does) or head (the
	// head's own record, for every engine). Only with prefix_aware.
	PrefixSource string `yaml:"prefix_source,omitempty"`
	// SessionAffinity sends requests that carry a session key to their
	// session's replica. Nil means true.
	SessionAffinity *bool `yaml:"session_affinity,omitempty"`
	// Balance tunes how the stage trades cache hits for balance; absent
	// keys take the defaults (docs/routing.md).
	Balance *Balance `yaml:"balance,omitempty"`
	// Deadline holds the stage's targets and, with policy deadline, its
	// capacity and admission (docs/routing.md).
	Deadline *Deadline `yaml:"deadline,omitempty"`
}

// Balance are a stage's balance constants (router.Balance); zero or
// absent: the default.
type Balance struct {
	Abs                int64   `yaml:"abs,omitempty"`
	Rel                float64 `yaml:"rel,omitempty"`
	ReplicateFactor    float64 `yaml:"replicate_factor,omitempty"`
	ReplicateSlack     int64   `yaml:"replicate_slack,omitempty"`
	ReplicateMaxBlocks int     `yaml:"replicate_max_blocks,omitempty"`
	RootBlocks         int     `yaml:"root_blocks,omitempty"`
	AffinityLoadFactor float64 `yaml:"affinity_load_factor,omitempty"`
}

// RouterBalance is the stage's balance as the router takes it.
func (s Stage) RouterBalance() router.Balance {
	if s.Balance == nil {
		return router.Balance{}
	}
	b := *s.Balance
	return router.Balance{
		Abs: b.Abs, Rel: b.Rel,
		ReplicateFactor: b.ReplicateFactor, ReplicateSlack: b.ReplicateSlack, ReplicateMaxBlocks: b.ReplicateMaxBlocks,
		RootBlocks: b.RootBlocks, AffinityLoadFactor: b.AffinityLoadFactor,
	}
}

// Affinity reports whether the stage uses session affinity.
func (s Stage) Affinity() bool { return s.SessionAffinity == nil || *s.SessionAffinity }

// EffectivePolicy is the stage's policy, or def when it names none.
func (s Stage) EffectivePolicy(def string) string {
	if s.Policy != "" {
		return s.Policy
	}
	if def == "" {
		return router.PolicyRoundRobin
	}
	return def
}

// checkRouting validates the stage's routing keys, given the default policy.
func (s Stage) checkRouting(i int, def string) error {
	policy := s.EffectivePolicy(def)
	if err := router.CheckPolicy(policy); err != nil {
		return fmt.Errorf("orchestrator: pipeline: stage %d (%s): %w", i, s.Name, err)
	}
	if err := s.RouterBalance().Check(); err != nil {
		return fmt.Errorf("orchestrator: pipeline: stage %d (%s): %w", i, s.Name, err)
	}
	if err := s.Deadline.check(fmt.Sprintf("stage %d (%s)", i, s.Name)); err != nil {
		return err
	}
	if s.Deadline.policyOnly() && policy != router.PolicyDeadline {
		return fmt.Errorf("orchestrator: pipeline: stage %d (%s): deadline capacity, margin, model, admission and rtf_window apply to policy deadline only, the stage's policy is %s", i, s.Name, policy)
	}
	if s.PrefixSource == "" {
		return nil
	}
	if !slices.Contains(router.PrefixSources, s.PrefixSource) {
		return fmt.Errorf("orchestrator: pipeline: stage %d (%s): unknown prefix_source %q (want one of %v)", i, s.Name, s.PrefixSource, router.PrefixSources)
	}
	if policy != router.PolicyPrefixAware {
		return fmt.Errorf("orchestrator: pipeline: stage %d (%s): prefix_source applies to policy prefix_aware only, the stage's policy is %s", i, s.Name, policy)
	}
	return nil
}

// StreamsBetweenStages reports whether stages stream into each other.
func (p Pipeline) StreamsBetweenStages() bool { return p.Streaming == nil || *p.Streaming }

// DefaultPipeline is the omni pipeline that `troupe up` runs.
func DefaultPipeline() Pipeline {
	return Pipeline{
		Model:  "troupe-omni-sim",
		Stages: []Stage{{Name: "thinker"}, {Name: "talker"}, {Name: "vocoder"}},
	}
}

// LoadPipeline reads and validates a pipeline file.
func LoadPipeline(path string) (Pipeline, error) {
	data, err := os.ReadFile(path)
	if err != nil {
		return Pipeline{}, fmt.Errorf("orchestrator: read pipeline: %w", err)
	}
	return ParsePipeline(data)
}

// ParsePipeline parses and validates pipeline YAML. Unknown keys are errors,
// so a typo does not silently fall back to a default.
func ParsePipeline(data []byte) (Pipeline, error) {
	var p Pipeline
	dec := yaml.NewDecoder(bytes.NewReader(data))
	dec.KnownFields(true)
	if err := dec.Decode(&p); err != nil {
		return Pipeline{}, fmt.Errorf("orchestrator: parse pipeline: %w", err)
	}
	if err := p.Validate(); err != nil {
		return Pipeline{}, err
	}
	return p, nil
}

// Validate checks that the pipeline is usable.
func (p Pipeline) Validate() error {
	if p.Model == "" {
		return errors.New("orchestrator: pipeline: model is required")
	}
	if len(p.Stages) == 0 {
		return errors.New("orchestrator: pipeline: at least one stage is required")
	}
	if err := p.Deadline.check("pipeline"); err != nil {
		return err
	}
	if p.Deadline.policyOnly() {
		return errors.New("orchestrator: pipeline: deadline capacity, margin, model, admission and rtf_window are set per stage, not for the pipeline")
	}
	seen := map[string]bool{}
	for i, s := range p.Stages {
		if s.Name == "" {
			return fmt.Errorf("orchestrator: pipeline: stage %d has no name", i)
		}
		if s.InputChunk < 0 {
			return fmt.Errorf("orchestrator: pipeline: stage %q: input_chunk must be 0 or more, got %d", s.Name, s.InputChunk)
		}
		if seen[s.Name] {
			return fmt.Errorf("orchestrator: pipeline: duplicate stage name %q", s.Name)
		}
		seen[s.Name] = true
		// The file alone: a stage without a policy takes the head's
		// default, which ValidateRouting checks against what it says.
		if err := s.checkRouting(i, router.PolicyPrefixAware); err != nil {
			return err
		}
	}
	return nil
}

// ValidateRouting checks every stage's routing with def as the default
// policy (the head's --policy).
func (p Pipeline) ValidateRouting(def string) error {
	for i, s := range p.Stages {
		if err := s.checkRouting(i, def); err != nil {
			return err
		}
	}
	return nil
}

// StageNames returns the stage names in order.
func (p Pipeline) StageNames() []string {
	out := make([]string, len(p.Stages))
	for i, s := range p.Stages {
		out[i] = s.Name
	}
	return out
}

// StageIndex returns the index of a stage name, or -1.
func (p Pipeline) StageIndex(name string) int {
	for i, s := range p.Stages {
		if s.Name == name {
			return i
		}
	}
	return -1
}
