// Package docs_test holds README.md and docs/*.md to the tree: every test,
// benchmark and fuzz target, every repository path and every troupe flag
// they cite exists. A citation this test refuses is fixed in the doc; only
// what truly lives outside the repository goes in foreignFlags.
package docs_test

import (
	"bufio"
	"bytes"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"
	"unicode"
)

// root is the repository root, relative to this package.
const root = ".."

// module is the module path; a path cited after it is a repository path.
const module = "github.com/troupe-serving/troupe/"

// foreignFlags are flags cited on a troupe command line that troupe does not
// define, by command, with the reason. Keep it short: a flag troupe used to
// have is fixed in the doc instead.
var foreignFlags = map[string]map[string]string{}

// ---- the docs -------------------------------------------------------------

type doc struct {
	name string // relative to root, slash-separated
	text string
	// prose is text with the fenced code blocks blanked (line numbers kept).
	prose string
	// commands are the shell command lines the doc cites: each fenced
	// block's lines (a trailing backslash joins the next) and each inline
	// code span.
	commands []string
}

func loadDocs(t *testing.T) []doc {
	t.Helper()
	names := []string{"README.md"}
	more, err := filepath.Glob(filepath.Join(root, "docs", "*.md"))
	if err != nil {
		t.Fatal(err)
	}
	for _, m := range more {
		rel, _ := filepath.Rel(root, m)
		names = append(names, filepath.ToSlash(rel))
	}
	if len(names) < 10 {
		t.Fatalf("found only %v: the docs are not where this test looks", names)
	}
	var docs []doc
	for _, name := range names {
		data, err := os.ReadFile(filepath.Join(root, name))
		if err != nil {
			t.Fatal(err)
		}
		d := doc{name: name, text: string(data)}
		d.prose, d.commands = splitCode(d.text)
		docs = append(docs, d)
	}
	return docs
}

var inlineCodeRE = regexp.MustCompile("`([^`]+)`")

// splitCode returns text without its fenced code blocks, and the command
// lines of those blocks and of the inline code spans.
func splitCode(text string) (prose string, commands []string) {
	var out []string
	fenced := false
	pending := ""
	for line := range strings.Lines(text) {
		line = strings.TrimRight(line, "\n")
		if strings.HasPrefix(strings.TrimSpace(line), "```") {
			fenced = !fenced
			out = append(out, "")
			if pending != "" {
				commands = append(commands, pending)
				pending = ""
			}
			continue
		}
		if !fenced {
			out = append(out, line)
			continue
		}
		out = append(out, "")
		if joined, ok := strings.CutSuffix(strings.TrimRight(line, " "), `\`); ok {
			pending += joined + " "
			continue
		}
		commands = append(commands, pending+line)
		pending = ""
	}
	prose = strings.Join(out, "\n")
	for _, m := range inlineCodeRE.FindAllStringSubmatch(prose, -1) {
		if !strings.Contains(m[1], "\n\n") { // a span never crosses a paragraph
			commands = append(commands, strings.ReplaceAll(m[1], "\n", " "))
		}
	}
	return prose, commands
}

// lineOf is the 1-based line of offset i in text, for messages.
func lineOf(text string, i int) int { return strings.Count(text[:i], "\n") + 1 }

// ---- the tree -------------------------------------------------------------

type tree struct {
	paths map[string]bool // every file and folder, slash-separated, relative to root
	// funcs are the test, benchmark and fuzz functions by name: the
	// folders whose _test.go files define them.
	funcs map[string][]string
}

var testFuncRE = regexp.MustCompile(`(?m)^func ((?:Test|Benchmark|Fuzz)\w*)\(`)

// loadTree walks the repository, leaving out .git and the top-level build
// outputs .gitignore names (/bin/, /dist/ ...), which no doc may rely on.
func loadTree(t *testing.T) tree {
	t.Helper()
	ignored := map[string]bool{".git": true}
	gi, err := os.ReadFile(filepath.Join(root, ".gitignore"))
	if err != nil {
		t.Fatal(err)
	}
	for _, line := range strings.Split(string(gi), "\n") {
		if name, ok := strings.CutPrefix(strings.TrimSpace(line), "/"); ok {
			ignored[strings.TrimSuffix(name, "/")] = true
		}
	}
	tr := tree{paths: map[string]bool{}, funcs: map[string][]string{}}
	err = filepath.WalkDir(root, func(p string, d fs.DirEntry, err error) error {
		if err != nil {
			return err
		}
		rel, _ := filepath.Rel(root, p)
		rel = filepath.ToSlash(rel)
		if rel == "." {
			return nil
		}
		if ignored[rel] {
			if d.IsDir() {
				return filepath.SkipDir
			}
			return nil
		}
		tr.paths[rel] = true
		if d.IsDir() || !strings.HasSuffix(rel, "_test.go") {
			return nil
		}
		src, err := os.ReadFile(p)
		if err != nil {
			return err
		}
		for _, m := range testFuncRE.FindAllSubmatch(src, -1) {
			tr.funcs[string(m[1])] = append(tr.funcs[string(m[1])], path.Dir(rel))
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(tr.funcs) < 100 {
		t.Fatalf("found only %d test functions: the walk did not find the tree", len(tr.funcs))
	}
	return tr
}

// ---- tests, benchmarks and fuzz targets -------------------------------------

var citedFuncRE = regexp.MustCompile(`\b(?:Test|Benchmark|Fuzz)[A-Z0-9_]\w*`)

// TestCitedTestsExist: every TestXxx, BenchmarkXxx and FuzzXxx a doc names
// is a function of some _test.go file.
func TestCitedTestsExist(t *testing.T) {
	tr := loadTree(t)
	cited := 0
	for _, d := range loadDocs(t) {
		for _, loc := range citedFuncRE.FindAllStringIndex(d.text, -1) {
			name := d.text[loc[0]:loc[1]]
			cited++
			if tr.funcs[name] == nil {
				t.Errorf("%s:%d: %s is no function of any _test.go file", d.name, lineOf(d.text, loc[0]), name)
			}
		}
	}
	t.Logf("%d names checked", cited)
	if cited < 20 {
		t.Errorf("only %d names cited: the pattern no longer finds them", cited)
	}
}

// TestCitedGoTestCommandsSelect: every `go test` command a doc cites names
// packages that exist, and each alternative of its -run, -bench and -fuzz
// patterns selects a function of those packages, as go test matches them:
// alternatives split at a top-level |, the first /-element against the
// function's name.
func TestCitedGoTestCommandsSelect(t *testing.T) {
	tr := loadTree(t)
	checked := 0
	for _, d := range loadDocs(t) {
		for _, line := range d.commands {
			for _, args := range invocations(line, func(w []word) int {
				if len(w) >= 2 && w[0].text == "go" && w[1].text == "test" {
					return 2
				}
				return 0
			}) {
				checked++
				for _, err := range checkGoTest(tr, args) {
					t.Errorf("%s: `%s`: %v", d.name, line, err)
				}
			}
		}
	}
	t.Logf("%d go test commands checked", checked)
	if checked < 15 {
		t.Errorf("only %d go test commands found: the extraction no longer finds them", checked)
	}
}

func checkGoTest(tr tree, args []word) []error {
	var errs []error
	type selection struct{ kind, pattern string }
	var sels []selection
	var dirs []string
	for i := 0; i < len(args); i++ {
		a := args[i].text
		switch {
		case strings.HasPrefix(a, "./") || a == ".":
			pkg := strings.TrimSuffix(strings.TrimPrefix(path.Clean(a), "./"), "/")
			if base, ok := strings.CutSuffix(pkg, "/..."); ok || pkg == "..." {
				if pkg == "..." {
					base = ""
				}
				if base != "" && !tr.paths[base] {
					errs = append(errs, fmt.Errorf("no folder %s", base))
				}
				for dir := range tr.dirsWithTests() {
					if base == "" || dir == base || strings.HasPrefix(dir, base+"/") {
						dirs = append(dirs, dir)
					}
				}
				continue
			}
			if !tr.dirsWithTests()[pkg] {
				errs = append(errs, fmt.Errorf("no package with tests at %s", a))
			}
			dirs = append(dirs, pkg)
		case strings.HasPrefix(a, "-"):
			name, value, hasValue := strings.Cut(strings.TrimLeft(a, "-"), "=")
			kind := map[string]string{"run": "Test", "bench": "Benchmark", "fuzz": "Fuzz"}[name]
			if kind == "" {
				continue
			}
			if !hasValue && i+1 < len(args) {
				i++
				value = args[i].text
			}
			sels = append(sels, selection{kind, value})
		}
	}
	for _, s := range sels {
		if s.pattern == "^$" { // selects nothing, on purpose
			continue
		}
		for _, alt := range splitTopLevel(s.pattern, '|') {
			first := splitTopLevel(alt, '/')[0]
			re, err := regexp.Compile(first)
			if err != nil {
				errs = append(errs, fmt.Errorf("pattern %q: %w", s.pattern, err))
				continue
			}
			if !tr.selects(re, s.kind, dirs) {
				errs = append(errs, fmt.Errorf("%q of %q selects no %s function in %v", first, s.pattern, s.kind, dirs))
			}
		}
	}
	return errs
}

func (tr tree) dirsWithTests() map[string]bool {
	out := map[string]bool{}
	for _, ds := range tr.funcs {
		for _, d := range ds {
			out[d] = true
		}
	}
	return out
}

// selects reports whether re matches a function of kind in one of dirs (in
// any folder when dirs is empty: the command names no package).
func (tr tree) selects(re *regexp.Regexp, kind string, dirs []string) bool {
	for name, in := range tr.funcs {
		if !strings.HasPrefix(name, kind) || !re.MatchString(name) {
			continue
		}
		if len(dirs) == 0 || slices.ContainsFunc(in, func(d string) bool { return slices.Contains(dirs, d) }) {
			return true
		}
	}
	return false
}

// splitTopLevel splits s at sep outside parentheses and brackets, as go
// test splits its -run and -bench patterns.
func splitTopLevel(s string, sep byte) []string {
	var out []string
	depth, start := 0, 0
	for i := 0; i < len(s); i++ {
		switch s[i] {
		case '(', '[':
			depth++
		case ')', ']':
			depth--
		case '\\':
			i++
		case sep:
			if depth == 0 {
				out = append(out, s[start:i])
				start = i + 1
			}
		}
	}
	return append(out, s[start:])
}

// ---- shell words ----------------------------------------------------------

type word struct {
	text   string
	quoted bool
}

// words splits a command line into shell words, quotes removed.
func words(line string) []word {
	var out []word
	var cur strings.Builder
	in, quoted, open := byte(0), false, false
	for i := 0; i < len(line); i++ {
		c := line[i]
		switch {
		case in != 0 && c == in:
			in = 0
		case in != 0:
			cur.WriteByte(c)
		case c == '\'' || c == '"':
			in, quoted, open = c, true, true
		case c == ' ' || c == '\t':
			if open {
				out = append(out, word{cur.String(), quoted})
			}
			cur.Reset()
			quoted, open = false, false
		default:
			cur.WriteByte(c)
			open = true
		}
	}
	if open {
		out = append(out, word{cur.String(), quoted})
	}
	return out
}

// ends reports whether w ends a simple command.
func ends(w word) bool {
	if w.quoted {
		return false
	}
	return slices.Contains([]string{"|", "||", "&&", ";", "&"}, w.text) ||
		strings.HasPrefix(w.text, "#") || strings.HasPrefix(w.text, ">") || strings.HasSuffix(w.text, ";")
}

// invocations returns the arguments of every command in line that start
// recognises: start returns how many words the command's name takes (0:
// not here).
func invocations(line string, start func([]word) int) [][]word {
	ws := words(line)
	var out [][]word
	for i := range ws {
		n := start(ws[i:])
		if n == 0 {
			continue
		}
		var args []word
		for _, w := range ws[i+n:] {
			if ends(w) {
				break
			}
			args = append(args, w)
		}
		out = append(out, args)
	}
	return out
}

// ---- troupe flags ---------------------------------------------------------

// troupeFlags builds cmd/troupe and reads each command's flags from its
// help.
func troupeFlags(t *testing.T) map[string]map[string]bool {
	t.Helper()
	gobin, err := exec.LookPath("go")
	if err != nil {
		t.Fatalf("go is not on PATH: %v", err)
	}
	bin := filepath.Join(t.TempDir(), "troupe")
	build := exec.Command(gobin, "build", "-o", bin, "./cmd/troupe")
	build.Dir = root
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("go build ./cmd/troupe: %v\n%s", err, out)
	}
	help := func(args ...string) string {
		cmd := exec.Command(bin, args...)
		cmd.WaitDelay = 10 * time.Second
		out, err := cmd.Output()
		if err != nil {
			t.Fatalf("troupe %s: %v", strings.Join(args, " "), err)
		}
		return string(out)
	}
	commandRE := regexp.MustCompile(`(?m)^  ([a-z]+)  `)
	flagRE := regexp.MustCompile(`(?m)^  -([a-z][a-z0-9-]*)`)
	out := map[string]map[string]bool{}
	for _, m := range commandRE.FindAllStringSubmatch(help("help"), -1) {
		flags := map[string]bool{"h": true, "help": true}
		for _, f := range flagRE.FindAllStringSubmatch(help("help", m[1]), -1) {
			flags[f[1]] = true
		}
		out[m[1]] = flags
	}
	for _, c := range []string{"up", "head", "worker", "etcd", "members", "trace"} {
		if len(out[c]) < 3 {
			t.Fatalf("troupe help %s: no flags read (%v): the help's format changed", c, out[c])
		}
	}
	return out
}

var flagNameRE = regexp.MustCompile(`^--?([a-z][a-z0-9-]*)$`)

// TestCitedTroupeFlagsExist: on every command line a doc cites that runs
// troupe (troupe, bin/troupe, /troupe, go run ./cmd/troupe, the image
// troupe:TAG), each flag is one that command defines.
func TestCitedTroupeFlagsExist(t *testing.T) {
	flags := troupeFlags(t)
	checked := 0
	for _, d := range loadDocs(t) {
		for _, line := range d.commands {
			var cmd string
			for _, args := range invocations(line, func(w []word) int {
				if len(w) < 2 || w[0].quoted {
					return 0
				}
				bin := strings.TrimLeft(w[0].text, "([")
				if base := path.Base(bin); base != "troupe" && !strings.HasPrefix(bin, "troupe:") {
					return 0
				}
				if flags[w[1].text] == nil {
					return 0
				}
				cmd = w[1].text
				return 2
			}) {
				for _, a := range args {
					name, _, _ := strings.Cut(strings.Trim(a.text, "[]()"), "=")
					m := flagNameRE.FindStringSubmatch(name)
					if m == nil {
						continue
					}
					checked++
					if flags[cmd][m[1]] || foreignFlags[cmd][m[1]] != "" {
						continue
					}
					t.Errorf("%s: `%s`: troupe %s has no flag -%s", d.name, line, cmd, m[1])
				}
			}
		}
	}
	t.Logf("%d flags checked", checked)
	if checked < 50 {
		t.Errorf("only %d flags checked: the extraction no longer finds the command lines", checked)
	}
}

// ---- paths ----------------------------------------------------------------

// TestCitedPathsExist: every repository path a doc cites exists: paths that
// start at a top-level folder (scripts/test.sh, internal/front/httpapi/,
// .ci/run, also after the module path), file names in inline code that
// some repository file ends with (fastdecode.go, httpapi/jsonenc.go), and
// relative markdown links with their #anchor.
func TestCitedPathsExist(t *testing.T) {
	tr := loadTree(t)
	docs := loadDocs(t)
	var tops []string
	for p := range tr.paths {
		if !strings.Contains(p, "/") && !strings.Contains(p, ".") || p == ".ci" {
			tops = append(tops, regexp.QuoteMeta(p))
		}
	}
	slices.Sort(tops)
	// A path starts at a top-level folder not preceded by a path or word
	// character (so URLs and foreign module paths do not count).
	pathRE := regexp.MustCompile(`(?:^|[^\w./:@~-])((?:` + strings.Join(tops, "|") + `)/[\w.*-]*(?:/[\w.*-]+)*/?)`)
	fileRE := regexp.MustCompile(`^[\w-]+(?:\.[\w-]+)*(?:/[\w.-]+)*\.(?:go|sh|ya?ml|json|txt|proto|md|cfg|Dockerfile)$`)
	linkRE := regexp.MustCompile(`\]\(([^)\s]+)\)`)
	anchors := map[string]map[string]bool{}
	for _, d := range docs {
		anchors[d.name] = headingAnchors(d.prose)
	}

	checked := 0
	exists := func(p string) bool {
		if strings.Contains(p, "*") {
			for q := range tr.paths {
				if ok, _ := path.Match(p, q); ok {
					return true
				}
			}
			return false
		}
		return tr.paths[p]
	}
	for _, d := range docs {
		text := strings.ReplaceAll(d.text, module, " ")
		for _, m := range pathRE.FindAllStringSubmatchIndex(text, -1) {
			p := strings.TrimRight(text[m[2]:m[3]], ".")
			checked++
			if !exists(strings.TrimSuffix(p, "/")) {
				t.Errorf("%s:%d: %s does not exist", d.name, lineOf(text, m[2]), p)
			}
		}
		for _, m := range inlineCodeRE.FindAllStringSubmatchIndex(d.prose, -1) {
			name := d.prose[m[2]:m[3]]
			if !fileRE.MatchString(name) || pathRE.MatchString(" "+name) {
				continue
			}
			checked++
			found := false
			for p := range tr.paths {
				if p == name || strings.HasSuffix(p, "/"+name) {
					found = true
					break
				}
			}
			if !found {
				t.Errorf("%s:%d: no file %s in the repository", d.name, lineOf(d.prose, m[2]), name)
			}
		}
		for _, m := range linkRE.FindAllStringSubmatchIndex(d.prose, -1) {
			target := d.prose[m[2]:m[3]]
			if strings.Contains(target, "://") || strings.HasPrefix(target, "mailto:") {
				continue
			}
			checked++
			where := fmt.Sprintf("%s:%d", d.name, lineOf(d.prose, m[2]))
			file, anchor, _ := strings.Cut(target, "#")
			if file == "" {
				file = d.name
			} else {
				file = path.Clean(path.Join(path.Dir(d.name), file))
			}
			if !tr.paths[file] {
				t.Errorf("%s: link %s: %s does not exist", where, target, file)
				continue
			}
			if anchor != "" {
				if a, ok := anchors[file]; !ok {
					t.Errorf("%s: link %s: an anchor into a file that is not a doc", where, target)
				} else if !a[anchor] {
					t.Errorf("%s: link %s: %s has no heading #%s", where, target, file, anchor)
				}
			}
		}
	}
	t.Logf("%d paths and links checked", checked)
	if checked < 100 {
		t.Errorf("only %d paths checked: the patterns no longer find them", checked)
	}
}

var headingRE = regexp.MustCompile(`^#{1,6}\s+(.*?)\s*#*\s*$`)
var headingLinkRE = regexp.MustCompile(`\[([^\]]*)\]\([^)]*\)`)

// headingAnchors are the anchors GitHub gives the headings of prose: lower
// case, punctuation but - and _ dropped, spaces as -, -1, -2 ... on repeats.
func headingAnchors(prose string) map[string]bool {
	out := map[string]bool{}
	seen := map[string]int{}
	sc := bufio.NewScanner(strings.NewReader(prose))
	for sc.Scan() {
		m := headingRE.FindStringSubmatch(sc.Text())
		if m == nil {
			continue
		}
		text := headingLinkRE.ReplaceAllString(m[1], "$1")
		var b bytes.Buffer
		for _, r := range strings.ToLower(text) {
			switch {
			case r == ' ':
				b.WriteByte('-')
			case r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r):
				b.WriteRune(r)
			}
		}
		slug := b.String()
		if n := seen[slug]; n > 0 {
			out[fmt.Sprintf("%s-%d", slug, n)] = true
		} else {
			out[slug] = true
		}
		seen[slug]++
	}
	return out
}
