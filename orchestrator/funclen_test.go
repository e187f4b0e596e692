package orchestrator

import (
	"go/ast"
	"go/parser"
	"go/token"
	"path/filepath"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
)

// maxFuncLines is the longest a function of the package (non-test files)
// may be, counted from the line of its opening brace to the line of its
// closing one: a reader should see a function whole, its pieces named.
const maxFuncLines = 80

// TestFunctionsAreShort parses the package's non-test files and fails for
// every function or method whose body is longer than maxFuncLines.
func TestFunctionsAreShort(t *testing.T) {
	files, err := filepath.Glob("*.go")
	require.NoError(t, err)
	fset := token.NewFileSet()
	checked := 0
	for _, name := range files {
		if strings.HasSuffix(name, "_test.go") {
			continue
		}
		f, err := parser.ParseFile(fset, name, nil, parser.SkipObjectResolution)
		require.NoError(t, err)
		for _, decl := range f.Decls {
			fn, ok := decl.(*ast.FuncDecl)
			if !ok || fn.Body == nil {
				continue
			}
			checked++
			lines := fset.Position(fn.Body.Rbrace).Line - fset.Position(fn.Body.Lbrace).Line + 1
			if lines > maxFuncLines {
				t.Errorf("%s: %s is %d lines long, more than %d: split it into named pieces",
					fset.Position(fn.Pos()), fn.Name.Name, lines, maxFuncLines)
			}
		}
	}
	require.NotZero(t, checked, "no function found: the test does not run in the package's folder")
}
