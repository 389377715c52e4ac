-- The parts of Quarto's HTML rendering that the docs preview needs, as a pandoc (2.17+) Lua filter:
--   * callouts (`::: {.callout-note}` ...) become titled boxes: the title is the callout's first heading,
--     else its `title` attribute, else the kind ("Note", "Warning", ...), as in Quarto;
--   * links to a notebook (`02_transject.ipynb#x`) go to its page (`transject.html#x`), and links into the
--     published site (nbdev's doc links) go to the local page, so the preview works offline.
-- `docs_preview.py` passes the page map and the site's address as metadata (`preview-pages`, `preview-site-url`).

local site_url, pages = nil, {}

local function read_meta(meta)
  if meta['preview-site-url'] then site_url = pandoc.utils.stringify(meta['preview-site-url']) end
  for nb, page in pairs(meta['preview-pages'] or {}) do pages[nb] = pandoc.utils.stringify(page) end
end

local function relink(target)
  if site_url and site_url ~= '' and target:sub(1, #site_url) == site_url then
    target = target:sub(#site_url + 1)
    if target == '' then target = 'index.html' end
  end
  local file, rest = target:match('^([%w_%-%.]+%.ipynb)(.*)$')
  if file and pages[file] then target = pages[file] .. rest end
  return target
end

local KINDS = {note = 'Note', tip = 'Tip', warning = 'Warning', important = 'Important', caution = 'Caution'}

local function callout(div)
  local kind
  for _, c in ipairs(div.classes) do
    local k = c:match('^callout%-(%a+)$')
    if k and KINDS[k] then kind = k end
  end
  if not kind then return nil end
  local blocks, title = div.content, nil
  if #blocks > 0 and blocks[1].t == 'Header' then
    title = blocks[1].content
    blocks = pandoc.List({table.unpack(blocks, 2)})
  elseif div.attributes['title'] then
    title = pandoc.read(div.attributes['title'], 'markdown').blocks[1].content
  else
    title = {pandoc.Str(KINDS[kind])}
  end
  local header = pandoc.Div({pandoc.Plain(title)}, pandoc.Attr('', {'callout-header'}))
  local body = pandoc.Div(blocks, pandoc.Attr('', {'callout-body'}))
  return pandoc.Div({header, body}, pandoc.Attr(div.identifier, {'callout', 'callout-' .. kind, 'callout-titled'}))
end

return {
  {Meta = read_meta},
  {Link = function(l) l.target = relink(l.target); return l end,
   Div = callout},
}
