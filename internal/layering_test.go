// Package internal_test holds the layering rule of the tree: each folder may
// import only the layers below it, so the folders keep showing the
// architecture (README.md, "What is where").
package internal_test

import (
	"go/build"
	"io/fs"
	"path/filepath"
	"strings"
	"testing"
)

const module = "github.com/troupe-serving/troupe/"

// forbidden lists, per folder prefix (relative to the module root), the
// folder prefixes its non-test code must not import.
var forbidden = map[string][]string{
	"pkg/":            {"membership", "orchestrator", "worker", "internal/", "cmd/"},
	"membership":      {"orchestrator", "worker", "internal/", "cmd/"},
	"internal/core/":  {"orchestrator", "worker", "internal/front/", "cmd/"},
	"orchestrator":    {"worker", "internal/front/", "cmd/"},
	"worker":          {"orchestrator", "internal/", "cmd/"},
	"internal/front/": {"worker", "cmd/"},
}

func TestLayering(t *testing.T) {
	root, err := filepath.Abs("..")
	if err != nil {
		t.Fatal(err)
	}
	checked := 0
	err = filepath.WalkDir(root, func(path string, d fs.DirEntry, err error) error {
		if err != nil || !d.IsDir() {
			return err
		}
		if name := d.Name(); strings.HasPrefix(name, ".") || name == "testdata" {
			return filepath.SkipDir
		}
		rel, _ := filepath.Rel(root, path)
		rel = filepath.ToSlash(rel)
		if strings.HasSuffix(rel, "test") {
			return nil // test helpers (orchestratortest, membershiptest...) sit above every layer
		}
		pkg, err := build.ImportDir(path, 0)
		if err != nil {
			return nil // no Go files, or only tests
		}
		for from, banned := range forbidden {
			if !strings.HasPrefix(rel, from) {
				continue
			}
			checked++
			for _, imp := range pkg.Imports {
				dep, ok := strings.CutPrefix(imp, module)
				if !ok {
					continue
				}
				for _, b := range banned {
					if strings.HasPrefix(dep, b) && !strings.HasPrefix(dep, from) {
						t.Errorf("%s imports %s: %s may not import %s", rel, dep, from, b)
					}
				}
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if checked < 10 {
		t.Fatalf("checked only %d packages: the walk did not find the tree", checked)
	}
}
