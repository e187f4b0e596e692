package orchestrator

import (
	"bytes"
	"errors"
	"fmt"
	"os"

	"gopkg.in/yaml.v3"
)

// Pipeline is the model and its ordered stages, from the pipeline file.
type Pipeline struct {
	Model  string  `yaml:"model"`
	Stages []Stage `yaml:"stages"`
}

// Stage is one step of the pipeline. Only Name is required.
type Stage struct {
	Name string `yaml:"name"`
}

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
	seen := map[string]bool{}
	for i, s := range p.Stages {
		if s.Name == "" {
			return fmt.Errorf("orchestrator: pipeline: stage %d has no name", i)
		}
		if seen[s.Name] {
			return fmt.Errorf("orchestrator: pipeline: duplicate stage name %q", s.Name)
		}
		seen[s.Name] = true
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
